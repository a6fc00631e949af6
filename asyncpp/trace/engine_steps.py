"""Pair the engine's `step_dispatched` / `step_completed` lines into one span per step.

A dispatch pairs with the first later completion of the same `step_id`
(ids repeat when one file holds several runs, so pairing is by time order,
not by id alone). A completion without a dispatch (the in-process `Engine`
only logs completions) starts `duration_ms` before it when that is known;
a dispatch never completed (the engine was killed) is kept with
`end_us=None`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from asyncpp.trace.records import ParsedLog, StepCompleted, StepDispatched


@dataclass(frozen=True)
class EngineStep:
    step_id: int
    start_us: int
    end_us: int | None  # None: dispatched, never completed
    num_reqs: int
    num_tokens: int
    is_failed: bool


def engine_steps(log: ParsedLog) -> list[EngineStep]:
    """Engine spans in start order; completions without a known start are left out."""
    timeline: list[tuple[int, int, StepDispatched | StepCompleted]] = [(d.t_us, 0, d) for d in log.dispatched]
    timeline += [(c.t_us, 1, c) for c in log.completed]  # 1: a dispatch at the same µs pairs first
    timeline.sort(key=lambda item: (item[0], item[1]))
    pending: defaultdict[int, deque[StepDispatched]] = defaultdict(deque)
    steps: list[EngineStep] = []
    for _, _, record in timeline:
        if isinstance(record, StepDispatched):
            pending[record.step_id].append(record)
            continue
        failed = record.step_id in log.failed_step_ids
        if pending[record.step_id]:
            start_us = pending[record.step_id].popleft().t_us
        elif record.duration_ms is not None:
            start_us = record.t_us - round(record.duration_ms * 1e3)
        else:
            continue
        steps.append(EngineStep(record.step_id, start_us, record.t_us, record.num_reqs, record.num_tokens, failed))
    for queue in pending.values():
        for d in queue:
            failed = d.step_id in log.failed_step_ids
            steps.append(EngineStep(d.step_id, d.t_us, None, d.num_reqs, d.num_tokens, failed))
    steps.sort(key=lambda s: s.start_us)
    return steps
