"""The in-process engine equals `transformers` on a tiny random Llama (float32)."""

from __future__ import annotations

import pytest
import torch

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import Sampler
from tests.conftest import tiny_config, tiny_prompts

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers `generate`, greedy, EOS disabled: (new tokens, per-step logits [n, vocab])."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits, dim=0)


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    return Engine(tiny_config(tiny_hf_dir))


def test_greedy_tokens_equal_transformers_generate(engine, hf_tiny_model):
    prompts = tiny_prompts(engine.arch.vocab_size, 8)
    results = engine.generate(prompts, GREEDY_32)
    for prompt, result in zip(prompts, results):
        expected, _ = hf_greedy(hf_tiny_model, prompt, 32)
        assert result.token_ids == expected
        assert result.finish_reason == "length"


def test_logits_close_to_transformers(engine, hf_tiny_model, monkeypatch):
    captured: list[torch.Tensor] = []
    original = Sampler.__call__

    def spy(self, logits, states):
        captured.append(logits.detach().clone())
        return original(self, logits, states)

    monkeypatch.setattr(Sampler, "__call__", spy)
    prompt = tiny_prompts(engine.arch.vocab_size, 8)[6]
    (result,) = engine.generate([prompt], GREEDY_32)
    ours = torch.cat(captured, dim=0)
    expected_tokens, hf_logits = hf_greedy(hf_tiny_model, prompt, 32)
    assert result.token_ids == expected_tokens
    assert ours.shape == hf_logits.shape
    torch.testing.assert_close(ours, hf_logits.float(), atol=1e-4, rtol=0)
