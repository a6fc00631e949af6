"""`LayerBalancer`: per-step stage boundaries within the shift windows, from a fitted cost model."""

from __future__ import annotations

import numpy as np
import pytest

from asyncpp.core.plan import ScheduledRequest, StepPlan
from asyncpp.engine.layer_balance import LayerBalancer, _step_features
from asyncpp.model.arch import ModelArch
from asyncpp.model.split import shift_windows

# SmolLM2-135M's shape.
SMOLLM2 = ModelArch(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64
)
RANGES = [(0, 18), (18, 30)]


def _plan(step_id: int, *, num_decode: int = 0, prompt_tokens: int = 0, context: int = 100, **kw) -> StepPlan:
    scheduled = [ScheduledRequest(f"d{i}", [1], context, [0], True) for i in range(num_decode)]
    if prompt_tokens:
        scheduled.append(ScheduledRequest("p", [1] * prompt_tokens, 0, [0], True))
    return StepPlan(step_id, scheduled, **kw)


def _true_times(plan: StepPlan, bounds: tuple[int, ...], per_layer_token_ms: float, head_per_row_ms: float) -> list[float]:
    """A machine where a layer costs per_layer_token_ms a token and the head head_per_row_ms a sampled row."""
    starts = [0, *bounds, 30]
    rows = sum(r.do_sample for r in plan.scheduled)
    times = [(starts[r + 1] - starts[r]) * plan.num_tokens * per_layer_token_ms for r in range(2)]
    times[-1] += rows * head_per_row_ms
    return [t / 1e3 for t in times]


def test_bounds_stay_in_the_windows_and_follow_the_step():
    balancer = LayerBalancer(SMOLLM2, RANGES, shift_windows(RANGES, 4))
    decode = balancer.bounds(_plan(0, num_decode=8))
    prompt = balancer.bounds(_plan(1, num_decode=1, prompt_tokens=500))
    # Decode steps: the last stage's head weighs, so the first stage takes more layers; a prompt
    # chunk samples one row, so its layers split about evenly: the boundary moves back down.
    assert 14 <= prompt[0] < decode[0] <= 22
    assert prompt[0] <= 16
    assert balancer.stats()["bounds_counts"] == {str(decode[0]): 1, str(prompt[0]): 1}


def test_fit_finds_the_split_that_evens_a_machine_out():
    """Stage times from a known machine (the head 3x the prior's cost): the fitted model picks the
    boundary that minimises the slower stage, for decode and prompt steps alike."""
    balancer = LayerBalancer(SMOLLM2, RANGES, shift_windows(RANGES, 4))
    per_layer_token_ms, head_per_row_ms = 0.06, 1.2
    rng = np.random.default_rng(0)
    for step_id in range(300):
        plan = _plan(step_id, num_decode=int(rng.integers(2, 16)), prompt_tokens=int(rng.choice([0, 0, 64, 300])))
        bounds = balancer.bounds(plan)
        balancer.observe(StepPlan(**{**plan.__dict__, "layer_bounds": bounds}), _true_times(plan, bounds, per_layer_token_ms, head_per_row_ms))
    for plan in (_plan(1000, num_decode=8), _plan(1001, num_decode=2, prompt_tokens=300)):
        best = min(range(14, 23), key=lambda b: max(_true_times(plan, (b,), per_layer_token_ms, head_per_row_ms)))
        chosen = balancer.bounds(plan)[0]
        slowest = max(_true_times(plan, (chosen,), per_layer_token_ms, head_per_row_ms))
        assert slowest <= max(_true_times(plan, (best,), per_layer_token_ms, head_per_row_ms)) * 1.05, (chosen, best)
    assert balancer.bounds(_plan(1002, num_decode=8))[0] >= 21  # 8 rows of head = 9.6 ms: ~4 layers' worth


def test_observe_skips_lent_and_empty_steps():
    balancer = LayerBalancer(SMOLLM2, RANGES, shift_windows(RANGES, 4))
    before = balancer.theta.copy()
    balancer.observe(_plan(0, num_decode=4, num_threads=2), [0.5, 0.5])  # lent threads: other stage times
    balancer.observe(StepPlan(1, []), [0.0, 0.0])
    assert balancer.num_observed == 0 and np.array_equal(balancer.theta, before)
    balancer.observe(_plan(2, num_decode=4), [0.004, 0.006])
    assert balancer.num_observed == 1 and not np.array_equal(balancer.theta, before)


def test_three_stages_each_keep_a_layer():
    ranges = [(0, 3), (3, 5), (5, 8)]
    arch = ModelArch(vocab_size=50000, hidden_size=64, intermediate_size=128, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16)
    balancer = LayerBalancer(arch, ranges, shift_windows(ranges, 4))
    for plan in (_plan(0, num_decode=16), _plan(1, prompt_tokens=400)):
        b1, b2 = balancer.bounds(plan)
        assert 0 < b1 < b2 < 8


def test_step_features():
    plan = _plan(0, num_decode=2, prompt_tokens=64, context=512)
    tokens, attention, samples = _step_features(plan)
    assert tokens == pytest.approx(66 / 64)
    assert attention == pytest.approx((2 * 513 + 64 * 64) / (64 * 1024))
    assert samples == pytest.approx(3 / 16)


def test_bounds_are_lowered_for_an_in_flight_step_sharing_blocks_and_counted_as_run():
    balancer = LayerBalancer(SMOLLM2, RANGES, shift_windows(RANGES, 4))
    plan = _plan(1, num_decode=8)
    wanted = balancer.wanted_bounds(plan)
    assert wanted[0] > 14  # decode steps give the first stage more layers
    racing = StepPlan(0, [ScheduledRequest("p", [1] * 32, 0, [0], False)], layer_bounds=(14,))  # shares block 0
    assert balancer.bounds(plan, [racing]) == (14,)
    assert balancer.bounds(plan) == wanted
    assert balancer.bounds(plan) == wanted
    assert balancer.stats()["bounds_counts"] == {"14": 1, str(wanted[0]): 2}
    # An in-flight step that named no bounds ran the static split (18 here).
    unnamed = StepPlan(0, [ScheduledRequest("p", [1] * 32, 0, [0], False)])
    lone = _plan(2, num_decode=1)  # one row of head: the first stage wants more than its 18 layers
    assert balancer.wanted_bounds(lone)[0] > 18 and balancer.bounds(lone, [unnamed]) == (18,)
