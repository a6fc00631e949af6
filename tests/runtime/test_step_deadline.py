"""`step_deadline`: which stage is hung, from the in-flight steps and the times their outputs arrived."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from asyncpp.runtime.step_deadline import hung_stages, waiting_since


@dataclass
class Step:
    step_id: int
    dispatched_at: float
    reported_at: dict[int, float] = field(default_factory=dict)
    after_step_id: int | None = None


def test_an_idle_pipeline_waits_on_nobody():
    assert waiting_since([], [0.0, 0.0]) == {}
    assert waiting_since([Step(3, 1.0, {0: 2.0, 1: 3.0})], [2.0, 3.0]) == {}


def test_the_clock_starts_at_dispatch_not_at_the_last_output_long_ago():
    # Both stages were idle since t=1 (their last outputs); a step went out at t=100.
    since = waiting_since([Step(7, 100.0)], [1.0, 1.0])
    assert since == {0: 100.0}  # stage 1 has no activations yet: it waits on stage 0
    assert hung_stages(since, 129.9, 30.0) == []
    assert hung_stages(since, 130.0, 30.0) == [0]


def test_a_busy_stage_restarts_its_clock_with_every_output():
    # Step 2 went out at t=0 behind step 1, which stage 0 finished at t=40 (stage 1 at 50).
    since = waiting_since([Step(2, 0.0)], [40.0, 50.0])
    assert since == {0: 40.0}
    assert hung_stages(since, 69.9, 30.0) == []  # 70 s after dispatch, 30 s after its last output
    assert hung_stages(since, 70.0, 30.0) == [0]


def test_a_stage_stuck_behind_a_full_handoff_is_not_blamed():
    # Stage 1 stopped while computing step 1 (from t=10); stage 0 finished step 1 at t=10 and
    # then step 2 stuck on the full buffer to stage 1. Only stage 1 is hung.
    steps = [Step(1, 0.0, {0: 10.0}), Step(2, 5.0)]
    since = waiting_since(steps, [10.0, 9.0])
    assert since == {1: 10.0}
    assert hung_stages(since, 40.0, 30.0) == [1]


def test_a_stage_starved_by_a_stopped_predecessor_is_not_blamed():
    # Stage 0 stopped while computing step 2 (dispatched at 20); stage 1 finished step 1 at 25.
    steps = [Step(2, 20.0)]
    since = waiting_since(steps, [19.0, 25.0])
    assert since == {0: 20.0}
    assert hung_stages(since, 60.0, 30.0) == [0]


def test_the_first_stage_waits_for_the_tokens_of_the_step_it_follows():
    # Async scheduling: step 2 samples after step 1; stage 1 (the last) owes step 1 since t=10.
    steps = [Step(1, 0.0, {0: 10.0}), Step(2, 1.0, after_step_id=1)]
    assert waiting_since(steps, [10.0, 9.0]) == {1: 10.0}
    # Once stage 1 reported step 1 (at 12), stage 0 could run step 2 from then on.
    steps = [Step(1, 0.0, {0: 10.0, 1: 12.0}), Step(2, 1.0, after_step_id=1)]
    assert waiting_since(steps, [10.0, 12.0]) == {0: 12.0}


def test_steps_are_taken_in_step_order_whatever_the_dict_order():
    steps = [Step(5, 3.0), Step(4, 2.0, {0: 4.0})]
    assert waiting_since(steps, [4.0, 0.0]) == {1: 4.0}


def test_three_stages_a_stopped_middle_stage_is_the_only_one_blamed():
    # Stage 1 stopped on step 1 (it got the activations at 10); stage 0 finished step 2 at 12 and
    # is stuck on step 3's handoff; stage 2 waits for step 1's activations.
    steps = [Step(1, 0.0, {0: 10.0}), Step(2, 1.0, {0: 12.0}), Step(3, 2.0)]
    since = waiting_since(steps, [12.0, 5.0, 6.0])
    assert since == {1: 10.0}


@pytest.mark.parametrize("now,expected", [(39.9, []), (40.0, [1]), (45.0, [1, 0])])
def test_hung_stages_longest_waiting_first(now, expected):
    assert hung_stages({0: 15.0, 1: 10.0}, now, 30.0) == expected
