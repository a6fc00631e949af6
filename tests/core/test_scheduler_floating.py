"""Async scheduling: a prompt's chunks float between cohorts.

A chunk needs no token from the plans before it, so any plan may take a prompt's
next chunk, however many plans hold its earlier ones, and it does not count against
that plan's cohort size. Without that, a cohort whose requests decode runs tiny
steps while the other cohort's prompt steps set the pipeline's pace (the stages
idled 35% of a long-prompt load with pp = 2).
"""

from __future__ import annotations

from sched_helpers import make_request

from asyncpp.core.scheduler import Scheduler
from asyncpp.core.step_builder import StepBuilder
from asyncpp.kv.block_manager import BlockManager


def _scheduler(*, async_scheduling: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, async_scheduling=async_scheduling
    )


def _entries(plan) -> list[tuple[str, int, int, bool]]:
    return [(e.request_id, e.start_position, e.num_tokens, e.do_sample) for e in plan.scheduled]


def test_a_prompt_goes_on_in_a_third_plan_while_two_hold_its_earlier_chunks() -> None:
    s = _scheduler()
    s.add_request(make_request("a", list(range(1, 49))))
    plans = [s.schedule(max_num_prefill_tokens=16) for _ in range(3)]
    assert [_entries(p) for p in plans] == [
        [("a", 0, 16, False)],
        [("a", 16, 16, False)],
        [("a", 32, 16, True)],  # the last chunk samples
    ]
    assert s.get_request("a").num_in_flight == 3
    assert s.schedule() is None  # its first token is not in yet
    for plan in plans[:2]:
        s.update_from_output(plan, {})
    s.update_from_output(plans[2], {"a": [7]})
    request = s.get_request("a")
    assert request.output_token_ids == [7] and not request.is_in_flight
    assert [(e.request_id, e.token_ids) for e in s.schedule().scheduled] == [("a", [7])]


def test_a_floating_chunk_does_not_count_against_the_cohort_size() -> None:
    s = _scheduler()
    s.add_request(make_request("d", [1, 2]))  # will decode
    s.add_request(make_request("p", list(range(1, 41))))  # a long prompt
    cohort_d = s.schedule(max_num_reqs=1)
    cohort_p = s.schedule(max_num_reqs=1, max_num_prefill_tokens=16)
    assert _entries(cohort_d) == [("d", 0, 2, True)]
    assert _entries(cohort_p) == [("p", 0, 16, False)]
    s.add_request(make_request("e", [3, 4]))
    # d's cohort goes on with d's next token and takes p's next chunk too (p is no member of it),
    # but not e: with d, the cohort has its one request.
    ahead = s.schedule(max_num_reqs=1, after_step_id=cohort_d.step_id, max_num_prefill_tokens=16)
    assert _entries(ahead) == [("d", 2, 1, True), ("p", 16, 16, False)]
    assert ahead.after_step_id == cohort_d.step_id and s.num_waiting == 1
    assert _entries(s.schedule(max_num_reqs=1, max_num_prefill_tokens=10)) == [("p", 32, 8, True), ("e", 0, 2, True)]


def test_a_floating_chunk_respects_the_prefill_share() -> None:
    s = _scheduler()
    s.add_request(make_request("p", list(range(1, 41))))
    s.schedule(max_num_prefill_tokens=16)
    assert _entries(s.schedule(max_num_prefill_tokens=8)) == [("p", 16, 8, False)]
    assert s.num_pending_prefill_tokens == 16


def test_without_async_scheduling_a_chunk_stays_with_its_plan() -> None:
    s = _scheduler(async_scheduling=False)
    s.add_request(make_request("p", list(range(1, 49))))
    first = s.schedule(max_num_prefill_tokens=16)
    second = s.schedule(after_step_id=first.step_id, max_num_prefill_tokens=16)
    assert _entries(second) == [("p", 16, 16, False)]
    assert s.schedule(after_step_id=first.step_id, max_num_prefill_tokens=16) is None
    assert s.schedule(after_step_id=second.step_id, max_num_prefill_tokens=16) is None  # one plan ahead at most


def test_several_floating_chunks_leave_the_cap_to_the_plans_own_requests():
    step = StepBuilder(step_id=7, num_budget_tokens=100, max_num_reqs=1, num_prefill_budget=100)
    for name in ("p", "q"):  # prompts whose earlier chunks are in flight
        request = make_request(name, list(range(1, 41)))
        request.num_computed_tokens, request.num_in_flight = 16, 1
        step.add(request, 8, [0, 1, 2, 3, 4, 5])
    assert step.num_floating == 2 and step.has_room
    step.add(make_request("e", [3, 4]), 2, [6])  # the plan's own request: the cap is reached
    assert step.num_floating == 2 and not step.has_room
