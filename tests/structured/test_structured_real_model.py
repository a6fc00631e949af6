"""Structured outputs on the real SmolLM2-135M-Instruct (float32): for every form, greedy output
equals `transformers`' greedy decoding under the same llguidance masks, step by step, and parses
and validates; pp = 2 with n-gram drafts gives the same tokens, and seeded samples too."""

from __future__ import annotations

import asyncio
import dataclasses
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


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_pd_pair_gives_the_same_tokens(greedy, temperature):
    """The prefill engine samples the first token under the grammar, the decode engine goes on."""
    pytest.importorskip("nixl_cu12")
    one, _, expected = greedy
    if temperature:
        chats, params = requests(temperature)
        expected = one.generate(chats, params)
    producer = Engine(config(2).replace(kv_transfer={"connector": "pd", "kv_role": "producer", "engine_id": "prefill"}))
    consumer = Engine(config(1).replace(kv_transfer={"connector": "pd", "kv_role": "consumer", "engine_id": "decode"}))
    try:
        consumer.kv_connector.add_remote_engine(producer.kv_connector.engine_handshake())
        chats, params = requests(temperature)
        handed = {}
        for chat, p in zip(chats, params):
            first = dataclasses.replace(p, max_tokens=1)
            handed[producer.add_request(chat, first, kv_transfer_params={"do_remote_decode": True})] = chat, p
        done = {}
        while len(done) < len(handed):
            for out in producer.step():
                if out.finished:
                    done[out.request_id] = out
        ids = [
            consumer.add_request(chat, p, kv_transfer_params=done[rid].kv_transfer_params)
            for rid, (chat, p) in handed.items()
        ]
        results = {rid: [] for rid in ids}
        while consumer.has_unfinished_requests() or producer.has_pending_transfers():
            for engine in (consumer, producer):
                for out in engine.step():
                    if out.request_id in results:
                        results[out.request_id] += out.token_ids
        firsts = [done[rid].token_ids for rid in handed]
        assert [f + results[rid] for f, rid in zip(firsts, ids)] == [r.token_ids for r in expected]
        texts = [r.text for r in expected]
        for form, text in zip(FORMS, texts):
            check(form, text)
        assert consumer.kv_connector.stats()["pd_num_pulls"] == len(FORMS)
    finally:
        consumer.close()
        producer.close()


# ---- served: launched (pp = 2, async scheduling, n-gram drafts) behind the OpenAI server ----------
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.http.test_openai_server import free_port
    from tests.runtime.harness import launched, real_sections

    port = free_port()
    sections = real_sections(2)
    sections["model"]["dtype"] = "float32"
    sections["scheduler"]["async_scheduling"] = True  # (the default) the next plan is made before the tokens are known
    sections["server"]["http_port"] = port
    sections["speculative"] = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    with launched(tmp_path_factory.mktemp("served"), sections, ready_timeout_s=300) as engine:
        yield engine, f"http://127.0.0.1:{port}"


async def test_served_greedy_under_async_scheduling_equals_the_engine_and_http_shapes(greedy, served):
    from asyncpp.client import AsyncClient
    from tests.runtime.conftest import collect

    openai = pytest.importorskip("openai")
    one, _, expected = greedy
    chats, sampled_params = requests(temperature=0.9)
    sampled = one.generate(chats, sampled_params)
    engine, base_url = served
    client = AsyncClient(engine.address)
    try:
        chats, params = requests()
        native = await asyncio.wait_for(asyncio.gather(*(collect(client, c, p) for c, p in zip(chats, params))), 300)
        native_sampled = await asyncio.wait_for(
            asyncio.gather(*(collect(client, c, p) for c, p in zip(chats, sampled_params))), 300
        )
    finally:
        client.close()
    assert [tokens for tokens, _, _ in native] == [r.token_ids for r in expected]
    assert [tokens for tokens, _, _ in native_sampled] == [r.token_ids for r in sampled]
    for form, (_, text, _) in zip(FORMS, native_sampled):
        check(form, text)
    oai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = (await oai.models.list()).data[0].id
    texts = {form: r.text for form, r in zip(FORMS, expected)}
    (spec, prompt), messages = FORMS["json"], [{"role": "user", "content": FORMS["json"][1]}]
    answer = await oai.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )  # fmt: skip
    assert answer.choices[0].message.content == texts["json"] and answer.choices[0].finish_reason == "stop"
    for form in ("regex", "choice", "grammar"):
        spec, prompt = FORMS[form]
        answer = await oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"structured_outputs": spec},
        )  # fmt: skip
        assert answer.choices[0].message.content == texts[form], form
    completion = await oai.completions.create(
        model=model, prompt="A JSON object about a dog:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].text), dict)
    else:
        assert completion.choices[0].text.startswith("{")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_tool_calls_validate_and_streamed_deltas_reassemble_to_the_same_call(served, tool_choice):
    openai = pytest.importorskip("openai")
    _, base_url = served
    oai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = (await oai.models.list()).data[0].id
    ask = {"model": model, "messages": WEATHER, "tools": [OTHER_TOOL, TOOL], "tool_choice": tool_choice,
           "max_tokens": MAX_TOKENS, "temperature": 0, "parallel_tool_calls": False}  # fmt: skip
    answer = await oai.chat.completions.create(**ask)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    else:
        assert tool_choice == "required" and json.loads(call.function.arguments) == {}
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in await oai.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": None, "arguments": ""})
            entry["name"] = part.function.name or entry["name"]
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"tools": [{**TOOL, "function": {**TOOL["function"], "parameters": {"type": "nope"}}}],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_what_does_not_compile_is_a_400_naming_the_field_and_the_server_keeps_serving(served, body, param):
    httpx = pytest.importorskip("httpx")
    _, base_url = served
    with httpx.Client(base_url=base_url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        ok = http.post("/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 4, "structured_outputs": {"choice": ["yes"]}})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "yes"
