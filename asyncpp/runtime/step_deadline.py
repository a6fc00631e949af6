"""The step deadline (`parallel.step_timeout_s`): which stage, if any, is hung.

A stage is hung when it has had work it could do for `step_timeout_s` and
reported nothing. "Work it could do" is its oldest unreported in-flight step
(stages run plans in dispatch order), once nothing outside the stage holds it
back:
* its plan was dispatched;
* it reported its previous step (the clock restarts with every output, so a
  busy stage is never hung however long the whole window has been full);
* rank > 0: the stage before it reported this step (its activations are there);
* rank 0, a plan scheduled after another (async scheduling): the last stage
  reported that one (it hands the sampled tokens straight to the first stage);
* rank < last: the stage after it reported every older step, so the handoff
  buffer between them is free (a stage stuck on a full buffer is waiting on
  its successor, not hung).
The clock of such a (step, rank) starts at the latest of those moments. In a
stall, the (step, rank) pair first in (step id, rank) order always qualifies
(everything it waits on comes before it), so a hung stage is always found,
and a stage blocked by a hung neighbour never does, so the blame is exact.
One step of one stage may take up to the deadline: a long prompt chunk on a
slow CPU needs a generous one.

Pure: the step window feeds it its in-flight steps and the times it saw
outputs arrive (`time.monotonic()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

_NOT_YET = float("inf")  # a moment that has not come: the stage waits on someone else


class InFlight(Protocol):
    """What the deadline reads of an in-flight step."""

    step_id: int
    after_step_id: int | None  # async scheduling: the step whose sampled tokens this one needs
    dispatched_at: float
    reported_at: Mapping[int, float]  # pp_rank -> when its output arrived


def waiting_since(steps: Iterable[InFlight], last_output_at: list[float]) -> dict[int, float]:
    """pp_rank -> since when it has had work it could do and reported nothing (ranks with none left out)."""
    by_id = {step.step_id: step for step in steps}
    ordered = [by_id[i] for i in sorted(by_id)]
    last = len(last_output_at) - 1
    since: dict[int, float] = {}
    for rank in range(last + 1):
        step = next((s for s in ordered if rank not in s.reported_at), None)
        if step is None:
            continue
        ready = [step.dispatched_at, last_output_at[rank]]
        if rank > 0:
            ready.append(step.reported_at.get(rank - 1, _NOT_YET))
        elif (parent := by_id.get(step.after_step_id)) is not None:
            ready.append(parent.reported_at.get(last, _NOT_YET))
        if rank < last:
            ready += [s.reported_at.get(rank + 1, _NOT_YET) for s in ordered if s.step_id < step.step_id]
        if (start := max(ready)) < _NOT_YET:
            since[rank] = start
    return since


def hung_stages(since: Mapping[int, float], now: float, timeout_s: float) -> list[int]:
    """The ranks past the deadline, longest waiting first."""
    return sorted((rank for rank, t in since.items() if now - t >= timeout_s), key=lambda rank: since[rank])

