"""How many prompt tokens one plan may take when cohorts share the pending prompts (async scheduling).

A prompt admitted whole into one cohort's step makes that step longer than the
other cohorts' steps, and every stage idles for the difference. Split over the
next plans (a prompt's chunks need no token, so they may go to any cohort), the
extra work lands evenly. The share is the cohort's part of what is pending, but
at least the prompt tokens of the plan dispatched just before (another cohort's,
which runs right before this one on every stage). Halving what is left at every
plan would make each step half as long as the one before it (315, 159, 76, ...
tokens when 16 prompts arrive together), and the first stage would idle while
the longer step finishes on the last.
"""

from __future__ import annotations

import math

from asyncpp.core.plan import StepPlan

# Smaller prompt chunks than this cost more in per-step overhead than they gain in balance.
MIN_PREFILL_SHARE_TOKENS = 16


def prefill_share(num_pending: int, max_cohorts: int, num_last_prefill_tokens: int) -> int:
    """Prompt tokens the next plan may take: its cohort's part of `num_pending`, or as many as the
    plan before it took (`num_last_prefill_tokens`), whichever is more."""
    share = max(math.ceil(num_pending / max_cohorts), min(num_last_prefill_tokens, num_pending))
    return max(MIN_PREFILL_SHARE_TOKENS, share)


def num_prefill_tokens(plan: StepPlan) -> int:
    """The prompt tokens of a plan: every token but a lone decode one."""
    return sum(r.num_tokens for r in plan.scheduled if r.num_tokens > 1)
