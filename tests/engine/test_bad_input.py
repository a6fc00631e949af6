"""Bad requests get an error naming the field, change no engine state, and do not disturb others."""

from __future__ import annotations

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    return Engine(tiny_config(tiny_hf_dir))  # max_model_len 256, vocab 320


BAD = [
    ("", GREEDY, "prompt", "empty"),
    ([], GREEDY, "prompt", "empty"),
    ([5] * 300, GREEDY, "prompt", "longer than max_model_len"),
    ([5] * 250, SamplingParams(max_tokens=10), "max_tokens", "exceeds max_model_len"),
    ([5, 6], SamplingParams(max_tokens=0), "max_tokens", "max_tokens must be >= 1"),
    ([5, 6], SamplingParams(temperature=-0.5), "temperature", "temperature"),
    ([5, 6], SamplingParams(temperature=float("inf")), "temperature", "finite"),
    ([5, 6], SamplingParams(top_p=0.0), "top_p", "top_p"),
    ([5, 6], SamplingParams(top_p=1.5), "top_p", "top_p"),
    ([5, 6], SamplingParams(top_k=-2), "top_k", "top_k"),
    ([5, 6], SamplingParams(repetition_penalty=1e-300), "repetition_penalty", "repetition_penalty"),
    ("a\ud800b", GREEDY, "prompt", "not valid Unicode"),
    ("word " * 2000, GREEDY, "prompt", "longer than max_model_len"),
    ([5, 320], GREEDY, "prompt_token_ids", "outside the vocabulary"),
    ([5, -1], GREEDY, "prompt_token_ids", "outside the vocabulary"),
    ([{"role": "user"}], GREEDY, "messages", "content"),
    (42, GREEDY, "prompt", "must be"),
]


@pytest.mark.parametrize("prompt,params,field,words", BAD)
def test_bad_request_is_rejected_without_state_change(engine, prompt, params, field, words):
    before = (engine.scheduler.num_waiting, engine.scheduler.num_running, engine.block_manager.num_free_blocks)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, params)
    assert info.value.field == field
    assert words in str(info.value)
    after = (engine.scheduler.num_waiting, engine.scheduler.num_running, engine.block_manager.num_free_blocks)
    assert before == after


def test_duplicate_request_id(engine):
    engine.add_request([5, 6, 7], GREEDY, request_id="dup")
    with pytest.raises(InvalidRequestError, match="duplicate request id") as info:
        engine.add_request([8, 9], GREEDY, request_id="dup")
    assert info.value.field == "request_id"
    while engine.has_unfinished_requests():
        engine.step()


def test_bad_requests_do_not_disturb_good_ones(engine):
    good = [[5, 6, 7, 8], [9, 10, 11]]
    expected = [r.token_ids for r in engine.generate(good, GREEDY)]
    ids = [engine.add_request(good[0], GREEDY)]
    for prompt, params, _, _ in BAD:
        with pytest.raises(InvalidRequestError):
            engine.add_request(prompt, params)
    ids.append(engine.add_request(good[1], GREEDY))
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    assert [tokens[i] for i in ids] == expected


def test_abort_frees_blocks(engine):
    rid = engine.add_request([5] * 40, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort(rid)
    assert out is not None and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
