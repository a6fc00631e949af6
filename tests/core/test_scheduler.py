"""Scheduler policy: budgets, chunked prefill, FCFS, in-flight cohorts, stops, aborts, preemption."""

from __future__ import annotations

import pytest
from sched_helpers import make_request

from asyncpp.core.plan import PLACEHOLDER_TOKEN_ID, StepPlan
from asyncpp.core.request import RequestStatus
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager


def _scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
    )


def _sample_all(plan: StepPlan, token_id: int = 1) -> dict[str, list[int]]:
    return {s.request_id: [token_id] for s in plan.scheduled if s.do_sample}


def _ids(plan: StepPlan | None) -> list[str]:
    assert plan is not None
    return [s.request_id for s in plan.scheduled]


# ------------------------------------------------------------------ construction
def test_cache_smaller_than_max_model_len_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        _scheduler(num_blocks=3, block_size=4, max_model_len=13)
    _scheduler(num_blocks=3, block_size=4, max_model_len=12, max_num_batched_tokens=12)


def test_unchunked_budget_must_hold_a_whole_sequence() -> None:
    with pytest.raises(ValueError, match="chunked prefill"):
        _scheduler(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)


def test_add_request_validation() -> None:
    s = _scheduler(max_model_len=16, max_num_batched_tokens=16)
    s.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("a", [3]))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("b", []))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("c", list(range(17))))
    assert s.num_waiting == 1 and s.get_request("a") is not None and s.get_request("b") is None


# ------------------------------------------------------------------ budgets
def test_token_budget_is_respected_and_the_rest_is_chunked() -> None:
    s = _scheduler(max_num_batched_tokens=16)
    for i in range(3):
        s.add_request(make_request(f"r{i}", [i + 1] * 10))  # distinct: no prefix hits
    plan = s.schedule()
    assert plan is not None and plan.num_tokens == 16
    assert [(r.request_id, r.num_tokens, r.do_sample) for r in plan.scheduled] == [("r0", 10, True), ("r1", 6, False)]
    assert [n.request_id for n in plan.new_requests] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 1
    s.update_from_output(plan, _sample_all(plan))
    plan = s.schedule()
    # r0 decodes (1), r1 finishes its prompt (4), r2 gets the remaining 11 -> 10 tokens.
    assert plan is not None and plan.num_tokens <= 16
    assert [(r.request_id, r.start_position, r.num_tokens) for r in plan.scheduled] == [
        ("r0", 10, 1),
        ("r1", 6, 4),
        ("r2", 0, 10),
    ]


def test_max_num_seqs_is_respected() -> None:
    s = _scheduler(max_num_seqs=2)
    for i in range(5):
        s.add_request(make_request(f"r{i}", [i + 1, 2], max_tokens=1 if i == 0 else 3))
    plan = s.schedule()
    assert _ids(plan) == ["r0", "r1"]
    assert s.schedule() is None  # both in flight, no seat for r2
    s.update_from_output(plan, _sample_all(plan))  # r0 reaches max_tokens=1
    assert s.num_running == 1
    plan = s.schedule()
    assert _ids(plan) == ["r1", "r2"] and s.num_running == 2


def test_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    s = _scheduler(max_num_batched_tokens=10)
    prompt = list(range(100, 125))  # 25 tokens
    s.add_request(make_request("long", prompt, max_tokens=2))
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        assert plan is not None and plan.num_tokens <= 10
        (scheduled,) = plan.scheduled
        chunks.append((scheduled.start_position, scheduled.token_ids, scheduled.do_sample))
        assert len(scheduled.block_ids) * 4 >= scheduled.start_position + scheduled.num_tokens
        updates = s.update_from_output(plan, {"long": [7]} if scheduled.do_sample else {})
        assert [u.new_token_ids for u in updates] == ([[7]] if scheduled.do_sample else [])
    assert chunks == [(0, prompt[:10], False), (10, prompt[10:20], False), (20, prompt[20:], True)]
    plan = s.schedule()
    assert plan is not None and plan.new_requests == []  # the runner already knows it
    (scheduled,) = plan.scheduled
    assert (scheduled.start_position, scheduled.token_ids, scheduled.do_sample) == (25, [7], True)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    s = _scheduler(max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=False)
    s.add_request(make_request("a", [1] * 30))
    s.add_request(make_request("b", [2] * 30))
    s.add_request(make_request("c", [1, 2, 3]))  # would fit, but must not jump over b
    plan = s.schedule()
    assert _ids(plan) == ["a"] and plan is not None and plan.scheduled[0].num_tokens == 30
    s.update_from_output(plan, _sample_all(plan))
    plan = s.schedule()
    assert _ids(plan) == ["a", "b", "c"]  # 1 + 30 + 3 tokens fit now


def test_fcfs_when_blocks_run_out() -> None:
    s = _scheduler(num_blocks=8, max_model_len=32, max_num_batched_tokens=64)
    s.add_request(make_request("big", list(range(100, 128))))  # 7 blocks
    s.add_request(make_request("next", list(range(50, 62))))  # 3 blocks: does not fit the 1 left
    s.add_request(make_request("small", [1, 2]))  # 1 block: would fit, must wait its turn
    plan = s.schedule()
    assert _ids(plan) == ["big"]
    assert s.num_waiting == 2


def test_prefix_cache_hit_sets_cached_tokens_and_start_position() -> None:
    s = _scheduler()
    prompt = list(range(10))
    s.add_request(make_request("a", prompt))
    plan_a = s.schedule()
    s.add_request(make_request("b", prompt))
    plan_b = s.schedule()
    assert plan_a is not None and plan_b is not None
    (scheduled,) = plan_b.scheduled
    assert scheduled.start_position == 8 and scheduled.token_ids == prompt[8:]
    assert scheduled.block_ids[:2] == plan_a.scheduled[0].block_ids[:2]
    b = s.get_request("b")
    assert b is not None and b.num_cached_tokens == 8
    assert s.stats().num_prefix_cache_hit_tokens == 8


# ------------------------------------------------------------------ pipelining
def test_in_flight_cohorts_are_disjoint_and_complete_in_any_order() -> None:
    s = _scheduler(max_num_batched_tokens=8)
    for i in range(6):
        s.add_request(make_request(f"r{i}", [i + 1] * 4))
    plans = [s.schedule() for _ in range(3)]
    assert [_ids(p) for p in plans] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    assert [p.step_id for p in plans if p is not None] == [0, 1, 2]
    assert s.schedule() is None  # everything is in flight
    assert s.num_in_flight_steps == 3
    p0, p1, p2 = plans
    assert p0 is not None and p1 is not None and p2 is not None
    s.update_from_output(p1, _sample_all(p1, 9))  # the middle plan comes back first
    plan = s.schedule()
    assert _ids(plan) == ["r2", "r3"] and plan is not None
    assert [(r.start_position, r.token_ids) for r in plan.scheduled] == [(4, [9]), (4, [9])]
    assert plan.step_id == 3
    assert s.schedule() is None
    with pytest.raises(ValueError, match="not in flight"):
        s.update_from_output(p1, _sample_all(p1))  # already applied
    s.update_from_output(p0, _sample_all(p0))
    assert _ids(s.schedule()) == ["r0", "r1"]


def test_step_without_its_sampled_token_is_rolled_back() -> None:
    s = _scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", [1, 2, 3, 4, 5, 6]))
    plan = s.schedule()
    assert plan is not None
    s.update_from_output(plan, {})  # a prompt chunk: nothing expected
    plan = s.schedule()
    assert plan is not None and plan.scheduled[0].do_sample
    chunk = plan.scheduled[0]
    assert s.update_from_output(plan, {}) == []  # a failed step: no token for it
    a = s.get_request("a")
    assert a is not None and a.num_computed_tokens == 4 and a.output_token_ids == [] and not a.is_in_flight
    retry = s.schedule()
    assert retry is not None and retry.new_requests == []
    assert (retry.scheduled[0].start_position, retry.scheduled[0].token_ids) == (chunk.start_position, chunk.token_ids)
    assert s.update_from_output(retry, {"a": [5]})[0].new_token_ids == [5]


def test_max_num_reqs_caps_one_plan_without_blocking_the_rest() -> None:
    s = _scheduler()
    for i in range(5):
        s.add_request(make_request(f"r{i}", [i + 1] * 3))
    plans = [s.schedule(max_num_reqs=2) for _ in range(3)]
    assert [_ids(p) for p in plans] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert s.schedule(max_num_reqs=2) is None
    for plan in plans:
        assert plan is not None
        s.update_from_output(plan, _sample_all(plan))
    assert _ids(s.schedule(max_num_reqs=3)) == ["r0", "r1", "r2"]
    assert _ids(s.schedule()) == ["r3", "r4"]


# ------------------------------------------------------------------ stops
def _run_scripted(s: Scheduler, request_id: str, script: list[list[int]]):
    """Feed `script[i]` as the sampled tokens of the i-th sampling step; return all updates."""
    updates = []
    for tokens in script:
        plan = s.schedule()
        assert plan is not None
        updates += s.update_from_output(plan, {request_id: tokens})
    return updates


def test_stop_token_id_finishes_with_stop_reason() -> None:
    s = _scheduler()
    s.add_request(make_request("a", [1, 2, 3], stop_token_ids=[5], max_tokens=10))
    updates = _run_scripted(s, "a", [[3], [5]])
    assert [(u.new_token_ids, u.finish_reason, u.stop_reason) for u in updates] == [([3], None, None), ([5], "stop", 5)]
    assert not s.has_unfinished_requests() and s.kv_usage == 0.0


def test_eos_finishes_unless_ignore_eos() -> None:
    s = _scheduler()
    s.add_request(make_request("a", [1, 2], eos_token_id=2, max_tokens=10))
    (update,) = _run_scripted(s, "a", [[2]])
    assert (update.finish_reason, update.stop_reason) == ("stop", None)

    s = _scheduler()
    s.add_request(make_request("b", [1, 2], eos_token_id=2, ignore_eos=True, max_tokens=3))
    updates = _run_scripted(s, "b", [[2], [2], [2]])
    assert [u.finish_reason for u in updates] == [None, None, "length"]


def test_max_tokens_and_max_model_len_finish_with_length() -> None:
    s = _scheduler()
    s.add_request(make_request("a", [1], max_tokens=2))
    assert [u.finish_reason for u in _run_scripted(s, "a", [[4], [4]])] == [None, "length"]

    s = _scheduler(num_blocks=4, max_model_len=8, max_num_batched_tokens=8)
    s.add_request(make_request("b", list(range(6)), max_tokens=100))
    assert [u.finish_reason for u in _run_scripted(s, "b", [[4], [4]])] == [None, "length"]
    b = s.get_request("b")
    assert b is None and s.kv_usage == 0.0


def test_stop_checks_run_in_order_and_drop_tokens_after_a_stop() -> None:
    s = _scheduler()
    s.add_request(make_request("a", [1], stop_token_ids=[5], eos_token_id=5, max_tokens=1))
    (update,) = _run_scripted(s, "a", [[5]])
    assert (update.finish_reason, update.stop_reason) == ("stop", 5)  # stop token wins over eos and max_tokens

    s = _scheduler()
    request = make_request("b", [1], eos_token_id=0, max_tokens=10)
    s.add_request(request)
    (update,) = _run_scripted(s, "b", [[3, 0, 8]])  # several tokens (speculative): cut at eos
    assert update.new_token_ids == [3, 0] and update.finish_reason == "stop"
    assert request.output_token_ids == [3, 0]


def test_finished_request_is_reported_to_the_runner_once() -> None:
    s = _scheduler()
    s.add_request(make_request("a", [1], max_tokens=1))
    s.add_request(make_request("b", [2], max_tokens=3))
    plan = s.schedule()
    assert plan is not None
    s.update_from_output(plan, _sample_all(plan))
    plan = s.schedule()
    assert plan is not None and plan.finished_req_ids == ["a"]
    s.update_from_output(plan, _sample_all(plan))
    plan = s.schedule()
    assert plan is not None and plan.finished_req_ids == []


# ------------------------------------------------------------------ aborts
def test_abort_waiting_running_and_in_flight_requests() -> None:
    s = _scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(10)), max_tokens=5))
    plan = s.schedule()
    assert _ids(plan) == ["r0", "r1"] and plan is not None
    # r2 waits (no seat); r0, r1 are in flight.
    finished = s.finish_requests(["r2", "r0", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["r2", "r0"]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in finished)
    assert s.finish_requests(["r0", "r2"], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    assert s.num_waiting == 0 and s.num_running == 1
    # r0's blocks are free right away, though its step is still in flight.
    assert s.get_request("r1") is not None
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("r0", [1]))  # its old step is not back yet
    updates = s.update_from_output(plan, _sample_all(plan))
    assert [u.request_id for u in updates] == ["r1"]  # r0's late token is dropped
    r0 = finished[1]
    assert r0.output_token_ids == [] and not r0.is_in_flight
    plan = s.schedule()
    assert plan is not None and plan.finished_req_ids == ["r0"]  # r2 was never sent to the runner
    # Abort a running (not in flight) request, then the in-flight one.
    s.update_from_output(plan, _sample_all(plan))
    s.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.kv_usage == 0.0
    s.add_request(make_request("r0", [1]))  # the id is free again
    assert _ids(s.schedule()) == ["r0"]


def test_finish_requests_requires_a_finished_status() -> None:
    s = _scheduler()
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests(["a"], RequestStatus.RUNNING)


# ------------------------------------------------------------------ preemption
def test_preempts_the_youngest_running_request_and_resends_it() -> None:
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=16, max_model_len=16)
    s.add_request(make_request("old", [1] * 8, max_tokens=2))
    s.add_request(make_request("young", [2] * 8, max_tokens=5))
    s.add_request(make_request("late", [5], max_tokens=1))
    plan = s.schedule()
    assert _ids(plan) == ["old", "young"] and plan is not None  # no block left for "late"
    s.update_from_output(plan, {"old": [3], "young": [4]})
    # Both need a third block; none is free: "young" is preempted for "old".
    plan = s.schedule()
    # One block is free again, enough for "late", but a step that preempted admits nobody.
    assert _ids(plan) == ["old"] and plan is not None and bm.num_free_blocks == 1
    young = s.get_request("young")
    assert young is not None and young.status is RequestStatus.PREEMPTED
    assert young.num_computed_tokens == 0 and young.num_preemptions == 1
    assert s.stats().num_preemptions == 1
    assert s.num_waiting == 2 and s.num_running == 1 and bm.block_ids("young") == []
    assert "young" not in plan.finished_req_ids
    s.update_from_output(plan, {"old": [3]})  # old reaches max_tokens
    plan = s.schedule()
    # "young" arrived before "late": it is admitted first.
    assert plan is not None and _ids(plan) == ["young", "late"]
    new = plan.new_requests[0]
    assert (new.request_id, new.prompt_token_ids, new.output_token_ids) == ("young", [2] * 8, [4])
    scheduled = plan.scheduled[0]
    # Its first block survived in the prefix cache (its tail was evicted first).
    assert scheduled.start_position == 4 and scheduled.token_ids == [2] * 4 + [4]
    assert scheduled.do_sample and plan.finished_req_ids == ["old"]
    assert young.num_cached_tokens == 0  # first-admission value, kept


def test_older_request_stalls_instead_of_preempting_itself_for_an_in_flight_younger_one() -> None:
    s = _scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=8)
    s.add_request(make_request("old", [1] * 8, max_tokens=5))
    s.add_request(make_request("young", [2] * 8, max_tokens=5))
    plan_old, plan_young = s.schedule(), s.schedule()
    assert _ids(plan_old) == ["old"] and _ids(plan_young) == ["young"]
    assert plan_old is not None and plan_young is not None
    s.update_from_output(plan_old, {"old": [3]})
    old = s.get_request("old")
    assert old is not None
    blocks_before = list(plan_old.scheduled[0].block_ids)
    assert s.schedule() is None  # old needs a block, young holds the rest and is in flight
    assert old.status is RequestStatus.RUNNING and old.num_preemptions == 0
    s.update_from_output(plan_young, {"young": [4]})
    plan = s.schedule()
    assert _ids(plan) == ["old"] and plan is not None
    assert plan.scheduled[0].block_ids[:2] == blocks_before  # its KV was kept
    young = s.get_request("young")
    assert young is not None and young.status is RequestStatus.PREEMPTED


def test_youngest_request_preempts_itself() -> None:
    s = _scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=8)
    s.add_request(make_request("old", [1] * 8, max_tokens=5))
    s.add_request(make_request("young", [2] * 8, max_tokens=5))
    plan_old, plan_young = s.schedule(), s.schedule()
    assert plan_old is not None and plan_young is not None
    s.update_from_output(plan_young, {"young": [4]})
    assert s.schedule() is None  # young preempts itself; nobody is admitted this step
    young = s.get_request("young")
    assert young is not None and young.status is RequestStatus.PREEMPTED and s.num_waiting == 1
    s.update_from_output(plan_old, {"old": [3]})
    assert _ids(s.schedule()) == ["old"]  # old gets young's freed blocks


def test_a_step_that_preempts_admits_nobody() -> None:
    # Without this rule a victim would come straight back with a small chunk, taking
    # blocks again in the very step that had to free them.
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=5, max_model_len=16)
    s.add_request(make_request("old", [1] * 8, max_tokens=5))
    s.add_request(make_request("young", [2] * 8, max_tokens=5))
    plan = s.schedule()
    assert plan is not None and [(r.request_id, r.num_tokens) for r in plan.scheduled] == [("old", 5)]
    s.update_from_output(plan, {})
    plan = s.schedule()
    assert plan is not None and [(r.request_id, r.num_tokens) for r in plan.scheduled] == [("old", 3), ("young", 2)]
    s.update_from_output(plan, {"old": [3]})
    # old takes the last free block; young needs a second one and, being the youngest,
    # preempts itself. Its first 4-token chunk would fit the block it freed, but not this step.
    plan = s.schedule()
    assert _ids(plan) == ["old"] and bm.num_free_blocks == 1
    young = s.get_request("young")
    assert young is not None and young.status is RequestStatus.PREEMPTED and s.num_waiting == 1
    assert plan is not None
    s.update_from_output(plan, {"old": [3]})
    assert _ids(s.schedule()) == ["old", "young"]  # next step it is admitted again


# ------------------------------------------------------------------ async scheduling
def test_async_next_plan_has_a_placeholder_for_the_token_in_flight() -> None:
    s = _scheduler(block_size=4)
    s.add_request(make_request("a", [5, 6, 7, 8], max_tokens=8))
    first = s.schedule()
    assert s.schedule() is None  # without after_step_id an in-flight request waits
    assert s.schedule(after_step_id=first.step_id + 1) is None  # nor does another plan's successor take it
    ahead = s.schedule(after_step_id=first.step_id)
    assert ahead is not None and ahead.after_step_id == first.step_id
    (entry,) = ahead.scheduled
    assert entry.token_ids == [PLACEHOLDER_TOKEN_ID] and entry.start_position == 4 and entry.do_sample
    assert len(entry.block_ids) == 2  # position 4 opens the second block
    assert s.schedule(after_step_id=ahead.step_id) is None  # at most two plans per request
    with pytest.raises(ValueError, match="came back before step 0, the plan it follows"):
        s.update_from_output(ahead, {"a": [12]})
    s.update_from_output(first, {"a": [11]})
    request = s.get_request("a")
    assert request.output_token_ids == [11] and request.num_placeholders == 0 and request.num_computed_tokens == 5
    s.update_from_output(ahead, {"a": [12]})
    assert request.output_token_ids == [11, 12] and not request.is_in_flight
    nxt = s.schedule()
    assert nxt.scheduled[0].token_ids == [12] and nxt.after_step_id is None


def test_async_prefix_cache_hashes_a_block_once_its_placeholder_is_known() -> None:
    bm = BlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    first = s.schedule()
    ahead = s.schedule(after_step_id=first.step_id)  # position 3 (a placeholder) fills block 0
    assert bm.num_cached_blocks == 0
    s.update_from_output(first, {"a": [9]})
    s.update_from_output(ahead, {"a": [10]})
    s.schedule()
    assert bm.num_cached_blocks == 1
    s.add_request(make_request("b", [1, 2, 3, 9, 4], max_tokens=2))
    assert bm.get_computed_blocks([1, 2, 3, 9, 4]) == ([ahead.scheduled[0].block_ids[0]], 4)


def test_async_no_token_after_one_that_finishes_by_length() -> None:
    s = _scheduler()
    s.add_request(make_request("a", [1, 2], max_tokens=1))
    s.add_request(make_request("b", [3, 4], max_tokens=2))
    a = s.get_request("a")
    first = s.schedule()
    ahead = s.schedule(after_step_id=first.step_id)
    assert _ids(ahead) == ["b"]  # a finishes with the token in flight
    s.update_from_output(first, _sample_all(first))
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert s.schedule(after_step_id=ahead.step_id) is None  # b's second token is its last


def test_async_request_that_stops_with_a_plan_ahead_frees_everything_when_it_is_back() -> None:
    bm = BlockManager(16, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    s.add_request(make_request("a", [1, 2, 3], eos_token_id=2, max_tokens=8))
    first = s.schedule()
    ahead = s.schedule(after_step_id=first.step_id)
    s.update_from_output(first, {"a": [2]})  # EOS: the plan ahead computed a token for nothing
    request = s.get_request("a")
    assert request.status is RequestStatus.FINISHED_STOPPED and bm.num_free_blocks == 16
    assert s.schedule() is None
    s.update_from_output(ahead, {"a": [5]})
    assert request.output_token_ids == [2] and s.get_request("a") is None


def test_prefill_share_splits_prompts_and_their_chunks_go_to_any_plan() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, async_scheduling=True)
    s.add_request(make_request("a", list(range(1, 41))))
    s.add_request(make_request("b", list(range(50, 60))))
    assert s.num_pending_prefill_tokens == 50
    first = s.schedule(max_num_prefill_tokens=25)
    assert [(e.request_id, e.num_tokens, e.do_sample) for e in first.scheduled] == [("a", 25, False)]
    assert s.num_pending_prefill_tokens == 25
    # A fresh plan (no after_step_id) continues a's prompt while its first chunk is in flight.
    second = s.schedule(max_num_prefill_tokens=20)
    assert [(e.request_id, e.start_position, e.num_tokens, e.do_sample) for e in second.scheduled] == [
        ("a", 25, 15, True),
        ("b", 0, 5, False),
    ]
    third = s.schedule(max_num_prefill_tokens=20)  # a has two plans out; b's rest needs no token either
    assert [(e.request_id, e.start_position, e.num_tokens, e.do_sample) for e in third.scheduled] == [
        ("b", 5, 5, True)
    ]
    assert s.schedule() is None
    s.update_from_output(first, {})
    s.update_from_output(second, {"a": [7]})
    s.update_from_output(third, {"b": [8]})
    fourth = s.schedule()
    assert [(e.request_id, e.token_ids) for e in fourth.scheduled] == [("a", [7]), ("b", [8])]


def test_without_async_scheduling_a_prompt_chunk_waits_for_its_plan() -> None:
    s = _scheduler(block_size=4)
    s.add_request(make_request("a", list(range(1, 41))))
    first = s.schedule(max_num_prefill_tokens=25)
    assert s.schedule() is None
    ahead = s.schedule(after_step_id=first.step_id)  # its own cohort's next plan may
    assert [(e.start_position, e.num_tokens) for e in ahead.scheduled] == [(25, 15)]
