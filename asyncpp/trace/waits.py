"""What each stage's bubbles waited on, and how the stages' step times compare by phase.

A stage runs its slices in order; the gap before a slice is charged to the
input that became ready last after the stage was free:

  plan         the engine dispatched the step (`step_dispatched`)
  activations  the previous stage finished the same step (stages after the first)
  tokens       the last stage finished the step's parent (`after_step_id`: the
               first stage waits for the tokens it samples, async scheduling)
  stage        none was late: the stage's own work between two slices

Phase balance: the last stage's slice time over the first stage's, median
over decode-only steps (one token per request) and over prompt-heavy steps
(at least two tokens per request). A ratio away from 1 that flips between the
phases is an imbalance no fixed layer split removes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from asyncpp.trace.records import ParsedLog, StageSlice, StepDispatched

CAUSES = ("plan", "activations", "tokens", "stage")


@dataclass(frozen=True)
class StageWaits:
    pp_rank: int
    span_us: int  # the stage's first slice start .. last slice end
    wait_us: dict[str, int]  # gap time by cause, every cause present

    @property
    def idle_us(self) -> int:
        return sum(self.wait_us.values())

    @property
    def idle_fraction(self) -> float:
        return self.idle_us / self.span_us if self.span_us > 0 else 0.0

    def fraction(self, cause: str) -> float:
        return self.wait_us[cause] / self.span_us if self.span_us > 0 else 0.0


@dataclass(frozen=True)
class PhaseBalance:
    decode_ratio: float | None  # median last / first stage slice time, decode-only steps
    num_decode: int
    prompt_ratio: float | None  # the same over prompt-heavy steps
    num_prompt: int


def stage_waits(log: ParsedLog) -> list[StageWaits]:
    """Per stage, its gaps charged to the cause that was ready last (see the module doc)."""
    ranks = log.pp_ranks
    by_rank = {r: sorted(log.stage_slices(r), key=lambda s: s.start_us) for r in ranks}
    end_of = {r: {s.step_id: s.end_us for s in by_rank[r]} for r in ranks}
    dispatched = {d.step_id: d for d in log.dispatched}
    result = []
    for i, rank in enumerate(ranks):
        # The first stage waits for the last stage's tokens; the others for the previous stage's activations.
        upstream = end_of[ranks[-1]] if i == 0 else end_of[ranks[i - 1]]
        slices = by_rank[rank]
        waits = dict.fromkeys(CAUSES, 0)
        for prev, cur in zip(slices, slices[1:]):
            gap = cur.start_us - prev.end_us
            if gap > 0:
                waits[_cause(cur, prev.end_us, dispatched, upstream, is_first=i == 0)] += gap
        result.append(StageWaits(rank, slices[-1].end_us - slices[0].start_us, waits))
    return result


def _cause(
    cur: StageSlice, free_us: int, dispatched: dict[int, StepDispatched], upstream: dict[int, int], is_first: bool
) -> str:
    ready = {}
    plan = dispatched.get(cur.step_id)
    if plan is not None:
        ready["plan"] = plan.t_us
    if not is_first and cur.step_id in upstream:
        ready["activations"] = upstream[cur.step_id]
    if is_first and plan is not None and plan.after_step_id in upstream:
        ready["tokens"] = upstream[plan.after_step_id]
    late = {cause: t for cause, t in ready.items() if t > free_us}
    return max(late, key=late.__getitem__) if late else "stage"


def phase_balance(log: ParsedLog) -> PhaseBalance | None:
    """Last / first stage slice time by phase; None with fewer than two stages."""
    ranks = log.pp_ranks
    if len(ranks) < 2:
        return None
    first = {s.step_id: s for s in log.stage_slices(ranks[0])}
    decode, prompt = [], []
    for s in log.stage_slices(ranks[-1]):
        head = first.get(s.step_id)
        if head is None or head.duration_us <= 0 or head.num_reqs <= 0:
            continue
        ratio = s.duration_us / head.duration_us
        if head.num_tokens == head.num_reqs:
            decode.append(ratio)
        elif head.num_tokens >= 2 * head.num_reqs:
            prompt.append(ratio)
    return PhaseBalance(
        statistics.median(decode) if decode else None,
        len(decode),
        statistics.median(prompt) if prompt else None,
        len(prompt),
    )


def format_waits(waits: list[StageWaits], balance: PhaseBalance | None) -> list[str]:
    lines = []
    for w in waits:
        parts = ", ".join(f"{c} {w.fraction(c):.1%}" for c in CAUSES if w.wait_us[c])
        lines.append(f"  stage {w.pp_rank} waited {w.idle_fraction:.1%}: {parts or '-'}")
    if balance is not None and (balance.num_decode or balance.num_prompt):

        def show(ratio: float | None, n: int) -> str:
            return f"{ratio:.2f} (n={n})" if ratio is not None else "- (n=0)"

        decode = show(balance.decode_ratio, balance.num_decode)
        prompt = show(balance.prompt_ratio, balance.num_prompt)
        lines.append(f"last / first stage step time: decode-only {decode}, prompt-heavy {prompt}")
    return lines
