"""`ordered_bounds`: a layer never moves to an earlier stage than an in-flight step that shares its KV ran it on."""

from __future__ import annotations

from asyncpp.core.plan import ScheduledRequest, StepPlan
from asyncpp.engine.kv_order import ordered_bounds, plan_block_ids

STATIC = (18,)


def _plan(step_id: int, block_ids: list[int], bounds: tuple[int, ...] = (), after: int | None = None) -> StepPlan:
    scheduled = [ScheduledRequest(f"r{step_id}", [1, 2], 0, block_ids, True)] if block_ids else []
    return StepPlan(step_id, scheduled, after_step_id=after, layer_bounds=bounds)


def test_a_chunk_after_one_in_flight_cannot_move_layers_to_an_earlier_stage():
    first_chunk = _plan(0, [3, 4], (16,))
    assert ordered_bounds((20,), _plan(1, [3, 4, 5]), [first_chunk], STATIC) == (16,)


def test_bounds_may_always_fall():
    assert ordered_bounds((15,), _plan(1, [3]), [_plan(0, [3], (20,))], STATIC) == (15,)


def test_steps_that_share_no_block_do_not_constrain():
    assert ordered_bounds((22,), _plan(1, [7, 8]), [_plan(0, [3, 4], (14,))], STATIC) == (22,)


def test_a_shared_prefix_block_is_enough():
    assert ordered_bounds((22,), _plan(1, [3, 9]), [_plan(0, [2, 3], (19,))], STATIC) == (19,)


def test_steps_the_first_stage_waits_for_are_exempt():
    """`after_step_id`: that step and every one before it are done on every stage when the plan starts."""
    parent, older = _plan(4, [3], (14,)), _plan(2, [3], (15,))
    assert ordered_bounds((21,), _plan(5, [3], after=4), [older, parent], STATIC) == (21,)
    later = _plan(5, [3], (17,))  # dispatched after the parent: not waited for
    assert ordered_bounds((21,), _plan(6, [3], after=4), [parent, later], STATIC) == (17,)


def test_a_plan_without_bounds_ran_the_static_split():
    assert ordered_bounds((22,), _plan(1, [3]), [_plan(0, [3])], STATIC) == STATIC


def test_each_boundary_is_lowered_on_its_own_and_by_the_lowest_racing_step():
    in_flight = [_plan(0, [1], (9, 21)), _plan(1, [1], (11, 19)), _plan(2, [5], (5, 16))]
    assert ordered_bounds((10, 22), _plan(3, [1]), in_flight, (10, 20)) == (9, 19)


def test_empty_plans_and_empty_in_flight_change_nothing():
    assert ordered_bounds((22,), _plan(1, [3]), [], STATIC) == (22,)
    assert ordered_bounds((22,), _plan(1, [3]), [_plan(0, [])], STATIC) == (22,)


def test_plan_block_ids_are_every_request_s_whole_table():
    plan = StepPlan(0, [ScheduledRequest("a", [1], 5, [1, 2], True), ScheduledRequest("b", [1], 5, [2, 7], True)])
    assert plan_block_ids(plan) == {1, 2, 7}


def test_every_in_flight_step_is_looked_at_not_only_the_first():
    """A step that does not constrain (its bounds are higher, or it shares no block) is passed over,
    and the ones after it still count."""
    higher, disjoint, racing = _plan(0, [3], (21,)), _plan(1, [8], (14,)), _plan(2, [3], (17,))
    assert ordered_bounds((20,), _plan(3, [3]), [higher, disjoint, racing], STATIC) == (17,)


def test_bounds_of_another_length_are_refused():
    import pytest

    with pytest.raises(ValueError):
        ordered_bounds((20, 25), _plan(1, [3]), [_plan(0, [3], (17,))], STATIC)
