"""`DraftPolicy`: drafts only where the expected accepted tokens pay for the rows (and, with async
scheduling, for the risk of voiding the planned next step); the acceptance and cost estimates."""

from __future__ import annotations

import random

import pytest

from asyncpp.speculative.policy import PRIOR_ACCEPTANCE, DraftPolicy, StepCost


def policy_with(acceptance: float, a: float = 1.0, b: float = 0.02, k: int = 4) -> DraftPolicy:
    policy = DraftPolicy(k)
    for _ in range(40):  # a cost fit: step time = a + b * tokens
        for tokens in (8, 16, 64):
            policy.observe_step(tokens, a + b * tokens)
    rng = random.Random(0)
    for _ in range(60):  # a request each of whose drafts is accepted with chance `acceptance`
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        policy.observe_acceptance("r", k, accepted)
    return policy


def test_the_cost_fit_recovers_the_line():
    cost = StepCost()
    for _ in range(20):
        for tokens in (1, 10, 100):
            cost.observe(tokens, 0.005 + 0.0002 * tokens)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.005, rel=1e-6) and b == pytest.approx(0.0002, rel=1e-6)
    assert cost.row_cost(1) < cost.row_cost(16) < cost.row_cost(64) < 1.0


def test_no_fit_without_spread_in_step_sizes():
    cost = StepCost()
    for _ in range(50):
        cost.observe(16, 0.01)
    assert cost.coefficients() is None


def test_high_acceptance_drafts_everything_found_at_any_concurrency():
    policy = policy_with(0.99)
    assert [policy.num_drafts("r", 4, n, is_continued=True) for n in (1, 16, 64)] == [4, 4, 4]
    assert policy.num_drafts("r", 2, 64) == 2  # never more than the proposer found


def test_low_acceptance_stops_drafting_where_rows_cost():
    policy = policy_with(0.3)
    assert policy.num_drafts("r", 4, 1) > 0  # a row is nearly free next to the weights at concurrency 1
    assert policy.num_drafts("r", 4, 64) == 0
    # With async scheduling a rejection voids the planned next step: stricter.
    assert policy.num_drafts("r", 4, 1, is_continued=True) < policy.num_drafts("r", 4, 1)


def test_acceptance_follows_the_observations_and_starts_drafting_when_they_turn():
    policy = policy_with(0.1)
    assert policy.acceptance("r") < 0.15
    assert policy.acceptance("new") == PRIOR_ACCEPTANCE
    assert policy.num_drafts("r", 4, 16, is_continued=True) == 0
    for _ in range(60):  # not drafting, its first drafts now come true (what the scheduler reports)
        policy.observe_acceptance("r", 1, 1)
    assert policy.acceptance("r") > 0.9
    assert policy.num_drafts("r", 4, 16, is_continued=True) == 4
    policy.forget("r")
    assert policy.acceptance("r") == PRIOR_ACCEPTANCE


def test_without_adaptive_every_draft_found_goes_in():
    policy = DraftPolicy(3, adaptive=False)
    policy.observe_acceptance("r", 3, 0)
    assert policy.num_drafts("r", 5, 64, is_continued=True) == 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DraftPolicy(0)
