"""Per-stage busy time and pipeline bubbles, and the CLI's text summary.

Definitions (all from `stage_done` slices):
  busy(stage)   = length of the union of the stage's slices
  span          = first slice start .. last slice end, over all stages
  bubble(stage) = 1 - busy(stage) / span
  mean bubble   = mean of bubble(stage) over the stages seen in the log
A span of zero (only empty slices) gives busy fraction 0, bubble 1.
What the bubbles waited on: `asyncpp.trace.waits`.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncpp.trace.intervals import union_length
from asyncpp.trace.records import ParsedLog
from asyncpp.trace.waits import format_waits, phase_balance, stage_waits


@dataclass(frozen=True)
class StageStats:
    pp_rank: int
    num_slices: int
    busy_us: int
    busy_fraction: float  # busy_us / span, 0..1
    mean_handoff_us: float  # over this stage's slices; 0 for the last stage

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_fraction


@dataclass(frozen=True)
class PipelineStats:
    span_start_us: int
    span_end_us: int
    stages: tuple[StageStats, ...]  # by pp_rank

    @property
    def span_us(self) -> int:
        return self.span_end_us - self.span_start_us

    @property
    def mean_bubble_fraction(self) -> float:
        return sum(s.bubble_fraction for s in self.stages) / len(self.stages)


def pipeline_stats(log: ParsedLog) -> PipelineStats | None:
    """Busy/bubble per stage; None when the log holds no `stage_done` slice."""
    if not log.slices:
        return None
    span_start = min(s.start_us for s in log.slices)
    span_end = max(s.end_us for s in log.slices)
    span = span_end - span_start
    stages = []
    for rank in log.pp_ranks:
        mine = log.stage_slices(rank)
        busy = union_length([(s.start_us, s.end_us) for s in mine])
        stages.append(
            StageStats(
                pp_rank=rank,
                num_slices=len(mine),
                busy_us=busy,
                busy_fraction=busy / span if span > 0 else 0.0,
                mean_handoff_us=sum(s.handoff_us for s in mine) / len(mine),
            )
        )
    return PipelineStats(span_start, span_end, tuple(stages))


def format_summary(log: ParsedLog, stats: PipelineStats | None) -> str:
    """A few lines for people: steps, span, per-stage busy/bubble, unused lines."""
    lines = []
    skipped = ", ".join(f"{reason}={n}" for reason, n in sorted(log.skipped.items()))
    skipped_text = f"{log.num_skipped} lines skipped" + (f" ({skipped})" if skipped else "")
    if stats is None:
        lines.append(
            "no stage_done lines in this log: stage slices are logged at debug level "
            "(run with --log-level debug --log-file FILE); the trace holds engine events only"
        )
    else:
        num_steps = len({s.step_id for s in log.slices})
        lines.append(f"{num_steps} steps on {len(stats.stages)} stages over {stats.span_us / 1e3:.1f} ms")
        for st in stats.stages:
            handoff = f", handoff {st.mean_handoff_us:.0f} µs/step" if st.mean_handoff_us else ""
            lines.append(
                f"  stage {st.pp_rank}: {st.num_slices} slices, busy {st.busy_fraction:6.1%}, "
                f"bubble {st.bubble_fraction:6.1%}{handoff}"
            )
        lines.append(f"mean bubble fraction {stats.mean_bubble_fraction:.1%}")
        lines.append("what the bubbles waited on (each gap charged to the input ready last):")
        lines.extend(format_waits(stage_waits(log), phase_balance(log)))
        num_repeated = len(log.slices) - len({(s.pp_rank, s.step_id) for s in log.slices})
        if num_repeated:
            lines.append(f"warning: {num_repeated} (stage, step_id) slices repeat; does the file hold several runs?")
    lines.append(
        f"engine: {len(log.dispatched)} dispatched, {len(log.completed)} completed, "
        f"{len(log.failed_step_ids)} failed; {skipped_text}, {log.num_other} other events"
    )
    return "\n".join(lines)
