"""Per-step layer bounds that keep every shared layer's KV reads and writes in step order.

With `parallel.shift_layers` a layer in a shift window runs on stage i in one
step and on stage i + 1 in another, over one KV cache the two stages share.
Each stage runs steps in dispatch order, and a step reaches stage i + 1 only
after stage i has handed it off. So if step M ran layer L on stage s and a
later step N runs it on stage s' >= s, M is done with L before N gets there.
If N runs L on an *earlier* stage (s' < s), nothing orders them: stage s' may
run N's layer L while stage s has not yet run M's. When N and M touch the
same KV blocks (N is the next chunk of a prompt M is computing, N hit blocks
M is still filling in the prefix cache, or N was given blocks an aborted
request's in-flight M still writes), N reads KV that is not written yet, or M
overwrites N's, and the output depends on which process the OS ran first.
This is what made greedy output change with the machine's load.

`ordered_bounds` therefore lowers each boundary of N to at most that boundary
of every in-flight step that shares a KV block with N: every layer then runs
on the same stage as in M or a later one. Steps up to N's `after_step_id` are
exempt: the first stage starts N only once their sampled tokens are in, which
the last stage sends after running them, so every stage is done with them.
Only where a boundary would rise are the block sets compared (steady decode
steps of disjoint cohorts cost nothing).
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncpp.core.plan import StepPlan


def ordered_bounds(
    wanted: tuple[int, ...], plan: StepPlan, in_flight: Iterable[StepPlan], static_bounds: tuple[int, ...]
) -> tuple[int, ...]:
    """`wanted` (where stages 1.. start `plan`), each boundary lowered to at most the same boundary
    of every in-flight plan `plan` may race with (`in_flight` in any order; `static_bounds`: the
    bounds of a plan that names none)."""
    bounds = tuple(wanted)
    blocks: frozenset[int] | None = None
    for other in in_flight:
        if other.is_empty or (plan.after_step_id is not None and other.step_id <= plan.after_step_id):
            continue
        theirs = other.layer_bounds or static_bounds
        if all(b <= t for b, t in zip(bounds, theirs, strict=True)):
            continue  # no layer moves to an earlier stage
        if blocks is None:
            blocks = plan_block_ids(plan)
        if blocks.isdisjoint(plan_block_ids(other)):
            continue
        bounds = tuple(min(b, t) for b, t in zip(bounds, theirs, strict=True))
    return bounds


def plan_block_ids(plan: StepPlan) -> frozenset[int]:
    """Every KV block a plan's forward may read or write: its requests' whole block tables."""
    return frozenset(block_id for r in plan.scheduled for block_id in r.block_ids)
