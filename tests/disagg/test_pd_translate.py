"""The router's pieces without sockets: prefill params, errors back as sent, frames, counters."""

from __future__ import annotations

import pytest

from asyncpp.client import _error_from
from asyncpp.disagg.front import _frames
from asyncpp.disagg.stats import RouterCounters, merged_stats
from asyncpp.samples import percentile
from asyncpp.disagg.translate import error_reply, handed_on, invalid, prefill_params
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_msgs import ErrorReply, HealthReply, RequestDelta, RequestDeltas


def test_prefill_params_ask_one_token_with_the_same_sampling():
    params = SamplingParams(max_tokens=50, temperature=0.7, seed=3, top_k=5, stop=["x"], stop_token_ids=[9],
                            logprobs=2, include_stop_str_in_output=True, repetition_penalty=1.2).to_dict()  # fmt: skip
    out = prefill_params(params)
    assert out == {**params, "max_tokens": 1}  # its token is the client's first: stops and logprobs apply
    SamplingParams.from_dict(out).validate()  # an engine takes it
    assert params["max_tokens"] == 50  # the client's own are untouched


def test_the_prefill_token_reaches_the_client_as_a_delta_that_goes_on():
    last = RequestDelta("e.pd1", "Hi", [7], True, "length", None, [{"7": -0.1}], 12, 4, {"remote_engine_id": "p"})
    assert handed_on(last) == RequestDelta("e.pd1", "Hi", [7], False, None, None, [{"7": -0.1}], 12, 4, None)


@pytest.mark.parametrize("reply", [
    ErrorReply("r", "sampling_params: max_tokens must be >= 1", "invalid_request", "sampling_params"),
    ErrorReply("r", "no field here", "invalid_request", None),
    ErrorReply("r", "the stage failed: x: y", "internal", None),
    ErrorReply("r", "engine shut down before the request finished", "shutdown", None),
])  # fmt: skip
def test_an_engines_error_comes_back_as_it_was_sent(reply):
    assert error_reply("r", _error_from(reply), "decode engine (tcp://x)") == reply


def test_an_engine_dead_error_names_the_engine():
    back = error_reply("r", _error_from(ErrorReply("r", "engine is dead: stage(s) [1] exited", "engine_dead")), "decode engine")
    assert back == ErrorReply("r", "decode engine: engine is dead: stage(s) [1] exited", "engine_dead")


def test_refused_kv_transfer_params_are_the_routers_fault_not_the_clients():
    sent = ErrorReply("r", "kv_transfer_params: unknown producer 'p'", "invalid_request", "kv_transfer_params")
    back = error_reply("r", _error_from(sent), "decode engine")
    assert back == ErrorReply("r", "decode engine refused the router's kv_transfer_params: unknown producer 'p'", "internal")


def test_a_refusal_reads_like_an_engines():
    assert invalid("r", "request_id", "must be a non-empty string") == ErrorReply(
        "r", "request_id: must be a non-empty string", "invalid_request", "request_id"
    )


def test_deltas_go_out_in_runs_with_other_messages_in_their_place():
    a, b = RequestDelta("engine-1", "a", [1]), RequestDelta("engine-2", "b", [2], True, "stop", "b", None, 3, 1, {"k": 1})
    error, reply = ErrorReply("c", "boom", "internal"), HealthReply(1, True)
    frames = _frames([("r1", a), ("r2", b), error, reply, ("r1", a)])
    assert [type(f) for f in frames] == [RequestDeltas, ErrorReply, HealthReply, RequestDeltas]
    assert frames[0].deltas() == [RequestDelta("r1", "a", [1]), RequestDelta("r2", "b", [2], True, "stop", "b", None, 3, 1, {"k": 1})]
    assert frames[3].deltas() == [RequestDelta("r1", "a", [1])]


def test_counters_and_merged_stats():
    counters = RouterCounters()
    assert counters.stats()["pd_second_token_s_p50"] is None and counters.stats()["pd_second_token_s_mean"] is None
    for s in (0.1, 0.2, 0.3, 0.4, 1.0):
        counters.second_token_done(s)
    counters.prefill_done(0.5)
    stats = counters.stats()
    assert stats["pd_second_token_s_mean"] == pytest.approx(0.4) and stats["pd_second_token_s_p50"] == 0.3
    assert stats["pd_second_token_s_p99"] == 1.0 and stats["pd_prefill_s_mean"] == 0.5
    merged = merged_stats({"num_running": 9}, {"num_running": 1}, stats)
    assert merged["num_running"] == 1 and merged["prefill"] == {"num_running": 9}
    assert merged_stats(None, None, {})["decode"] is None
    assert percentile([3, 1, 2], 50) == 2
