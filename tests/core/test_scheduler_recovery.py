"""`Scheduler.recompute_all`: after the stages restart, every request ends with the tokens of an undisturbed run.

The fake model (`sched_helpers.FakeKVModel`) computes each token from the KV it
reads back through the block table, so a request whose KV was not recomputed
(or a token applied from a discarded plan) changes its output.
"""

from __future__ import annotations

import random

import pytest
from sched_helpers import FakeKVModel, drive_async, make_request, solo_output

from asyncpp.core.request import RequestStatus
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
NUM_BLOCKS = 96


def _scheduler() -> Scheduler:
    return Scheduler(
        BlockManager(NUM_BLOCKS, BLOCK_SIZE), max_num_seqs=8, max_num_batched_tokens=24,
        max_model_len=MAX_MODEL_LEN, async_scheduling=True,
    )  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_restarts_mid_run_leave_every_request_its_undisturbed_output(seed):
    rng = random.Random(seed)
    requests = [
        make_request(
            f"r{i}", [rng.randrange(1, 97) for _ in range(rng.randrange(2, 40))],
            max_tokens=rng.randrange(2, 14), eos_token_id=rng.choice([None, 3, 11]),
        )  # fmt: skip
        for i in range(12)
    ]
    expected = {r.request_id: solo_output(r, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN) for r in requests}
    scheduler = _scheduler()
    for request in requests:
        scheduler.add_request(request)
    num_plans, _ = drive_async(scheduler, FakeKVModel(NUM_BLOCKS, BLOCK_SIZE), max_cohorts=2, restart_after=frozenset({3, 4, 11, 25}))
    assert num_plans > 25  # every restart happened, two in a row included
    assert {r.request_id: r.output_token_ids for r in requests} == expected
    assert scheduler.num_recomputed_requests > 0 and scheduler.num_recomputed_tokens > 0
    assert scheduler.stats().num_preemptions == 0  # a restart is no preemption
    assert scheduler._block_manager.num_free_blocks == NUM_BLOCKS and not scheduler._requests


def test_recompute_all_requeues_running_requests_with_their_tokens_and_empties_the_cache():
    scheduler = _scheduler()
    scheduler.add_request(make_request("a", list(range(1, 10)), max_tokens=8))
    scheduler.add_request(make_request("b", list(range(20, 24)), max_tokens=8))
    first = scheduler.schedule()
    scheduler.update_from_output(first, {"a": [5], "b": [6]})
    second = scheduler.schedule()
    ahead = scheduler.schedule(after_step_id=second.step_id)  # placeholders in flight
    assert ahead is not None and scheduler._block_manager.num_cached_blocks > 0
    recompute = scheduler.recompute_all()
    assert (recompute.num_requests, recompute.num_tokens, recompute.num_discarded_steps) == (2, 9 + 2 + 4 + 2, 2)
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    for request, output in ((a, [5]), (b, [6])):
        assert request.status is RequestStatus.PREEMPTED and request.output_token_ids == output
        assert request.num_computed_tokens == request.num_placeholders == request.num_in_flight == 0
    assert scheduler._block_manager.num_cached_blocks == 0
    with pytest.raises(ValueError, match="not in flight"):
        scheduler.update_from_output(second, {"a": [7], "b": [8]})  # a discarded plan is never applied
    plan = scheduler.schedule()
    assert [(e.request_id, e.token_ids) for e in plan.scheduled] == [("a", [*range(1, 10), 5]), ("b", [20, 21, 22, 23, 6])]
    assert sorted(n.request_id for n in plan.new_requests) == ["a", "b"] and plan.finished_req_ids == []
    assert plan.preempted_req_ids == []


def test_a_request_finished_while_in_flight_is_forgotten_by_a_restart():
    scheduler = _scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    plan = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_request("a") is not None  # its plan is still out
    scheduler.recompute_all()
    assert scheduler.get_request("a") is None and not scheduler.has_unfinished_requests()
    assert scheduler.schedule() is None and plan.step_id not in scheduler._in_flight


def test_a_request_aborted_during_recovery_is_named_to_no_new_stage():
    scheduler = _scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    scheduler.add_request(make_request("b", [4, 5, 6], max_tokens=8))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"a": [7], "b": [8]})
    scheduler.recompute_all()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # while the stages restart
    assert scheduler.get_request("a") is None
    plan = scheduler.schedule()
    assert [e.request_id for e in plan.scheduled] == ["b"] and plan.finished_req_ids == []
    assert scheduler._block_manager.num_free_blocks == NUM_BLOCKS - len(plan.scheduled[0].block_ids)


def test_a_restart_resets_drafts_in_flight_and_counts_no_preemption_and_adds_up():
    scheduler = _scheduler()
    scheduler.add_request(make_request("a", list(range(1, 9)), max_tokens=8))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"a": [5]})
    a = scheduler.get_request("a")
    a.draft_token_ids, a.num_draft_tokens = [6, 7], 2  # as a drafting request with drafts in flight
    first = scheduler.recompute_all()
    assert (a.draft_token_ids, a.num_draft_tokens, a.num_preemptions) == ([], 0, 0)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"a": [6]})
    second = scheduler.recompute_all()
    assert (first.num_tokens, second.num_tokens) == (8, 9) and a.num_preemptions == 0  # KV computed so far
    assert (scheduler.num_recomputed_requests, scheduler.num_recomputed_tokens) == (2, 17)
