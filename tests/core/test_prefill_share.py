"""The prompt share of a plan: the cohort's part of what is pending, at least what the plan before took."""

from __future__ import annotations

from asyncpp.core.plan import ScheduledRequest, StepPlan
from asyncpp.core.prefill_share import MIN_PREFILL_SHARE_TOKENS, num_prefill_tokens, prefill_share


def test_a_burst_splits_into_equal_steps():
    """16 prompts of 68 tokens arrive together, two cohorts: the second plan matches the first
    instead of taking half of what is left (which made steps of 544, 272, 136, ... tokens)."""
    pending, last, shares = 16 * 68, 0, []
    while pending:
        share = min(prefill_share(pending, 2, last), pending)
        shares.append(share)
        pending, last = pending - share, share
    assert shares == [544, 544]


def test_share_follows_the_pending_tokens_and_has_a_floor():
    assert prefill_share(100, 2, 0) == 50
    assert prefill_share(100, 2, 80) == 80  # the plan before took 80: so may this one
    assert prefill_share(30, 2, 80) == 30  # never more than is pending...
    assert prefill_share(10, 2, 0) == MIN_PREFILL_SHARE_TOKENS  # ...but chunks of at least the floor


def test_prefill_tokens_of_a_plan_leave_out_decode_rows():
    plan = StepPlan(0, [ScheduledRequest("a", [1], 9, [0], True), ScheduledRequest("b", [1, 2, 3], 0, [1], False)])
    assert num_prefill_tokens(plan) == 3
