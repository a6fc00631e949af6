"""A synthetic asyncpp JSON-lines log of a pipelined run, with the ground truth it was made from.

`simulate` plays a pp-stage pipeline with up to `max_in_flight` steps in
flight: the engine dispatches step n when step n - max_in_flight completes;
stage k starts step n once the plan has arrived, stage k-1 has handed off
step n, and stage k has finished step n-1; a non-last stage's slice ends
with its hand-off write. It writes exactly the lines the engine and stages
log (`stage_done`, `step_dispatched`, `step_completed`, plus noise events
with extra fields), in t_us order as in a file several processes append to.

`with_bad_lines` mixes in lines the parser must skip and reports how many,
by reason, so tests compare counts against what was injected.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

T_START_US = 1_760_000_000_000_000  # a realistic epoch-µs origin


@dataclass(frozen=True)
class TrueSlice:
    pp_rank: int
    step_id: int
    start_us: int
    end_us: int


@dataclass
class SimLog:
    pp_size: int
    num_steps: int
    lines: list[str]
    slices: list[TrueSlice]
    dispatch_us: list[int]
    complete_us: list[int]
    skipped: Counter[str] = field(default_factory=Counter)  # bad lines injected, by reason

    def text(self) -> str:
        return "\n".join(self.lines)  # no trailing newline: the last line may be a truncated one

    def busy_us(self, pp_rank: int) -> int:
        # Slices of one stage never overlap in the simulation, so busy is a plain sum.
        return sum(s.end_us - s.start_us for s in self.slices if s.pp_rank == pp_rank)

    @property
    def span_us(self) -> int:
        return max(s.end_us for s in self.slices) - min(s.start_us for s in self.slices)


def _line(t_us: int, event: str, level: str = "debug", **fields: object) -> tuple[int, str]:
    ts = datetime.fromtimestamp(t_us / 1e6, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    return t_us, json.dumps({**fields, "event": event, "level": level, "ts": ts, "t_us": t_us})


def simulate(pp_size: int = 3, num_steps: int = 24, max_in_flight: int = 3, seed: int = 0) -> SimLog:
    rng = random.Random(seed)
    lines: list[tuple[int, str]] = [_line(T_START_US - 5_000, "engine_ready", "info", role="engine", pp_rank=None)]
    for k in range(pp_size):
        loaded = _line(T_START_US - 9_000 + k, "model_slice_loaded", "info", role="stage", pp_rank=k, start_layer=k * 4)
        lines.append(loaded)
        lines.append(_line(T_START_US - 8_000 + k, "stage_ready", "info", role="stage", pp_rank=k))
    for r in range(4):
        lines.append(_line(T_START_US - 1_000 + r, "request_received", "info", role="engine", request_id=f"req-{r}"))

    dispatch: list[int] = []
    complete: list[int] = []
    stage_free = [T_START_US] * pp_size  # when each stage finished its previous step
    slices: list[TrueSlice] = []
    num_waiting = 6
    for n in range(num_steps):
        d = T_START_US + 40 * n if n < max_in_flight else complete[n - max_in_flight] + rng.randint(20, 60)
        dispatch.append(d)
        is_prefill = n < max_in_flight
        num_reqs = 2 if is_prefill else rng.randint(1, 3)
        num_tokens = rng.randint(40, 120) if is_prefill else num_reqs
        step_fields = dict(step_id=n, num_reqs=num_reqs, num_tokens=num_tokens)
        lines.append(_line(d, "step_dispatched", role="engine", pp_rank=None, **step_fields))
        ready = d + 100  # the plan reaches the stages
        for k in range(pp_size):
            start = max(ready, stage_free[k] + 15)
            compute = 300 + 6 * num_tokens + rng.randint(0, 200)
            handoff = rng.randint(40, 150) if k < pp_size - 1 else 0
            end = start + compute + handoff
            slices.append(TrueSlice(k, n, start, end))
            stage_fields = dict(role="stage", pp_rank=k, step_id=n, num_tokens=num_tokens, num_reqs=num_reqs)
            lines.append(
                _line(end + 5, "stage_done", **stage_fields, start_us=start, end_us=end,
                      busy_ms=round((end - start) / 1e3, 3), handoff_us=float(handoff))
            )
            stage_free[k] = end
            ready = end + 20  # the activation notice reaches stage k+1
        c = stage_free[pp_size - 1] + rng.randint(60, 120)
        complete.append(c)
        num_waiting = max(0, num_waiting - 1)
        lines.append(
            _line(c, "step_completed", role="engine", pp_rank=None, **step_fields,
                  duration_ms=round((c - d) / 1e3, 3), num_running=4 + (n % 3), num_waiting=num_waiting,
                  kv_usage=round(min(1.0, 0.05 + 0.03 * n), 4))
        )
    finished = _line(complete[-1] + 50, "request_finished", "info", role="engine", request_id="req-0")
    lines.append(finished)
    lines.sort(key=lambda item: item[0])  # stable: same-µs lines keep emission order
    return SimLog(pp_size, num_steps, [text for _, text in lines], slices, dispatch, complete)


def with_bad_lines(log: SimLog, seed: int = 1) -> SimLog:
    """The same log with garbage, other programs' lines, non-objects, blanks and a truncated last line."""
    rng = random.Random(seed)
    bad = [
        ("not_json", "INFO something happened"),
        ("not_json", "garbage {{{ not json"),
        ("not_json", "Traceback (most recent call last):"),
        ("not_object", "[1, 2, 3]"),
        ("not_object", '"just a json string"'),
        # start_us as a string: a known event with a mistyped required field.
        ("bad_fields", _line(T_START_US, "stage_done", role="stage", pp_rank=0, step_id=99, start_us="1", end_us=2)[1]),
    ]
    ignored = [json.dumps({"msg": "another program's json", "level": "info"}), "", "   "]
    lines = list(log.lines)
    for _, text in bad:
        lines.insert(rng.randrange(1, len(lines)), text)
    for text in ignored:
        lines.insert(rng.randrange(1, len(lines)), text)
    # A killed process leaves half a line at the end of the file.
    t_end = log.complete_us[-1] + 100
    cut_fields = dict(role="stage", pp_rank=1, step_id=log.num_steps, start_us=t_end - 500, end_us=t_end)
    last = _line(t_end, "stage_done", **cut_fields)[1]
    lines.append(last[: len(last) // 2])
    skipped = Counter(reason for reason, _ in bad)
    skipped["not_json"] += 1
    return SimLog(log.pp_size, log.num_steps, lines, log.slices, log.dispatch_us, log.complete_us, skipped)
