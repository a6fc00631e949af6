"""Sampling through the engine: seeds reproduce whatever the batch, stops, logprobs."""

from __future__ import annotations

import math

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    return Engine(tiny_config(tiny_hf_dir))


def test_seeded_request_reproduces_alone_and_in_a_batch(engine):
    prompts = tiny_prompts(320, 6)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([prompts[0]], seeded)[0].token_ids
    noisy = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = engine.generate([prompts[1], prompts[0], prompts[2]], [noisy, seeded, noisy])
    assert batch[1].token_ids == alone
    other_seed = engine.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_1_equals_greedy(engine):
    prompts = tiny_prompts(320, 4)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    top1 = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, top_k=1, ignore_eos=True))
    assert [r.token_ids for r in greedy] == [r.token_ids for r in top1]


def test_stop_token_ids_and_max_tokens(engine):
    prompt = tiny_prompts(320, 1)[0]
    full = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert full.finish_reason == "length" and len(full.token_ids) == 16


def test_stop_string_truncates_text(engine):
    prompt = tiny_prompts(320, 3)[2]
    full = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = full.text
    # Pick a stop string from the middle of the text that is not at its very start.
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i)
    cut = text.index(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    )[0]
    assert kept.text == text[: cut + len(stop)]


def test_logprobs_of_sampled_and_top_tokens(engine):
    prompt = tiny_prompts(320, 1)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert len(lp.top_token_ids) == 3
        assert lp.top_token_ids[0] == token_id  # greedy picks the most likely token
        assert math.isclose(lp.token_logprob, lp.top_logprobs[0], abs_tol=1e-6)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_missing_model_file_and_unsupported_source(tmp_path):
    with pytest.raises(FileNotFoundError):
        Engine(tiny_config(tmp_path / "missing"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="garbage.gguf"):
        Engine(tiny_config(tmp_path).replace(model={"source": "gguf", "path": str(garbage)}))


def test_generate_rejects_bad_prompt_and_keeps_serving(engine):
    with pytest.raises(InvalidRequestError):
        engine.generate([""], SamplingParams(max_tokens=2))
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids


def test_generate_is_all_or_nothing(engine):
    with pytest.raises(InvalidRequestError):
        engine.generate([[5, 6, 7], [8, 9], ""], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
