"""Structured outputs on the real SmolLM2-135M-Instruct (float32): for every form, greedy output
equals `transformers`' greedy decoding under the same llguidance masks, step by step, and parses
and validates; pp = 2 with n-gram drafts gives the same tokens, and seeded samples too."""

from __future__ import annotations

import json
import re

import pytest
import torch

from asyncpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.structured import StructuredOutputs

jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.real_model]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "code": {"enum": ["FR", "DE", "IT"]}},
                    "required": ["name", "code"], "additionalProperties": False},  # fmt: skip
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 2},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "country", "sights", "rating"],
    "additionalProperties": False,
}
REGEX = r"(Yes|No)\. [A-Z][a-z]+( [a-z]+){1,6}\."
GBNF = 'root ::= "Answer: " num " " unit "."\nnum ::= [1-9] [0-9]?\nunit ::= "km" | "miles"'
FORMS = {
    "json": ({"json": SCHEMA}, "Describe Paris as JSON: city, country (name and code), sights and a rating."),
    "json_object": ({"json_object": True}, "Give a JSON object with the keys name and age for a cat named Tom aged 3."),
    "regex": ({"regex": REGEX}, "Is Paris in France? Answer yes or no and say why."),
    "choice": ({"choice": ["Paris", "London", "Berlin", "Rome"]}, "What is the capital of Germany?"),
    "grammar": ({"grammar": GBNF}, "How far is Paris from Versailles?"),
}
MAX_TOKENS = 64


def check(form: str, text: str) -> None:
    """The output is in the form's language."""
    if form == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif form == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif form == "regex":
        assert re.fullmatch(REGEX, text), text
    elif form == "choice":
        assert text in FORMS["choice"][0]["choice"], text
    else:
        assert re.fullmatch(r"Answer: [1-9][0-9]? (km|miles)\.", text), text


def config(pp_size: int = 1, **speculative) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(source="gguf", dtype="float32", max_model_len=512),
        parallel=ParallelConfig(pp_size=pp_size, num_threads=1),
        cache=CacheConfig(kv_cache_memory_mb=64),
        speculative=SpeculativeConfig(**speculative) if speculative else SpeculativeConfig(),
    )


def requests(temperature: float = 0.0) -> tuple[list, list[SamplingParams]]:
    chats = [[{"role": "user", "content": prompt}] for _, prompt in FORMS.values()]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=11 if temperature else None, structured_outputs=spec)
        for spec, _ in FORMS.values()
    ]
    return chats, params


def hf_masked_greedy(model, compiler, prompt_ids: list[int], spec: StructuredOutputs) -> list[int]:
    """`transformers`' float32 logits, the grammar's mask on each step's row, argmax; until end of sequence."""
    matcher = compiler.matcher(spec)
    ids = torch.tensor([prompt_ids])
    past, out = None, []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            step = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            logits = step.logits[0, -1].float()
            allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) != 0
            token = int(logits.masked_fill(~allowed[: logits.shape[0]], float("-inf")).argmax())
            out.append(token)
            if token == compiler.eos_token_id:
                break
            assert matcher.consume_token(token)
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module")
def greedy():
    engine = Engine(config())
    try:
        chats, params = requests()
        prompts = [engine.input_processor.tokenize(chat) for chat in chats]
        yield engine, prompts, engine.generate(chats, params)
    finally:
        engine.close()


def test_masked_greedy_equals_transformers_under_the_same_masks_and_validates(greedy, hf_smollm2):
    engine, prompts, results = greedy
    _, model = hf_smollm2
    compiler = engine.input_processor.grammars
    for (form, (spec, _)), prompt_ids, result in zip(FORMS.items(), prompts, results):
        expected = hf_masked_greedy(model, compiler, prompt_ids, StructuredOutputs.from_dict(spec))
        assert result.token_ids == expected, (form, result.text)
        assert result.finish_reason == "stop", (form, result.text)  # the grammar ended it
        check(form, result.text)


def test_pp2_with_ngram_drafts_gives_the_same_tokens_greedy_and_seeded(greedy):
    _, _, expected = greedy
    one = Engine(config())
    try:
        chats, sampled_params = requests(temperature=0.9)
        sampled = one.generate(chats, sampled_params)
    finally:
        one.close()
    two = Engine(config(2, method="ngram", num_speculative_tokens=4, adaptive=False))
    try:
        chats, params = requests()
        assert [r.token_ids for r in two.generate(chats, params)] == [r.token_ids for r in expected]
        assert [r.token_ids for r in two.generate(chats, sampled_params)] == [r.token_ids for r in sampled]
        stats = two.scheduler.stats()
        assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0  # some drafts rejected
    finally:
        two.close()
    for form, result in zip(FORMS, sampled):
        check(form, result.text)
