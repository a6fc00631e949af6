"""Typed records read from an asyncpp JSON-lines log.

All times are wall-clock microseconds since the epoch (the log's `t_us`
clock), so records from different processes line up. `ParsedLog` is what
`asyncpp.trace.parse` returns: the records in file order plus counts of the
lines that were not used, by reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StageSlice:
    """One stage's compute slice of one step (`stage_done`); waiting for the previous stage is excluded."""

    pp_rank: int
    step_id: int
    start_us: int
    end_us: int
    num_tokens: int = 0
    num_reqs: int = 0
    handoff_us: float = 0.0  # time spent writing activations to stage pp_rank + 1 (0 on the last stage)

    @property
    def duration_us(self) -> int:
        return self.end_us - self.start_us


@dataclass(frozen=True)
class StepDispatched:
    """The engine broadcast step `step_id`'s plan to the stages (`step_dispatched`)."""

    step_id: int
    t_us: int
    num_reqs: int = 0
    num_tokens: int = 0
    after_step_id: int | None = None  # async scheduling: the step whose sampled tokens this one waits for


@dataclass(frozen=True)
class StepCompleted:
    """The engine received every stage's output of a step (`step_completed`); gauges are optional."""

    step_id: int
    t_us: int
    num_reqs: int = 0
    num_tokens: int = 0
    duration_ms: float | None = None  # dispatch -> completion, as the engine measured it
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # fraction of KV blocks in use, 0..1


@dataclass(frozen=True)
class StageRestart:
    """A restart of the stages (`asyncpp.runtime.recovery`): `stage_lost` to `stage_recovered`."""

    lost_us: int
    pp_ranks: tuple[int, ...]
    cause: str  # "exited" | "hung"
    recovered_us: int | None = None  # None: the engine never served again (or the log ends first)


@dataclass
class ParsedLog:
    """Everything the trace needs from one log file.

    `skipped` counts non-blank lines that could not be used, by reason:
    `not_json` (garbage, other programs' text, truncated objects),
    `not_object` (valid JSON that is not an object), `bad_fields` (one of the
    events above with a missing or mistyped required field). Valid objects
    with other events are counted in `num_other`, blank lines in `num_blank`.
    """

    slices: list[StageSlice] = field(default_factory=list)
    dispatched: list[StepDispatched] = field(default_factory=list)
    completed: list[StepCompleted] = field(default_factory=list)
    failed_step_ids: set[int] = field(default_factory=set)  # engine-side `step_failed`
    restarts: list[StageRestart] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    num_other: int = 0
    num_blank: int = 0

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def pp_ranks(self) -> list[int]:
        return sorted({s.pp_rank for s in self.slices})

    def stage_slices(self, pp_rank: int) -> list[StageSlice]:
        """One stage's slices, in log order."""
        return [s for s in self.slices if s.pp_rank == pp_rank]

    @property
    def step_ids(self) -> set[int]:
        return {s.step_id for s in self.slices} | {c.step_id for c in self.completed}
