"""Build a Chrome Trace Event Format object (chrome://tracing, ui.perfetto.dev) from a parsed log.

Layout, with `ts`/`dur` in µs relative to the earliest timestamp used:
  pid 1 "engine"       one "X" slice per step, dispatch -> completion; steps
                       in flight overlap, so each goes on a lane (tid) that
                       is free at its start; counters "requests"
                       (running/waiting) and "kv_usage" from step_completed.
  pid 2+k "stage k"    one "X" slice per `stage_done`, named "step N"; lanes
                       as on the engine, normally all on tid 0.
  flows                "s" on stage k's slice of step N -> "f" (bp "e") on
                       stage k+1's slice of step N: the activation hand-off.
Within one (pid, tid) no two "X" slices overlap. Flow points sit strictly
inside their slice (when it lasts 2 µs or more) so a viewer binds each to
that slice and not to a neighbour that touches it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from asyncpp.trace.engine_steps import EngineStep, engine_steps
from asyncpp.trace.intervals import assign_lanes
from asyncpp.trace.records import ParsedLog, StageSlice
from asyncpp.trace.stats import PipelineStats

ENGINE_PID = 1  # pid 0 reads as the kernel's idle task in some viewers
RESTART_TID = 999  # the engine track's row of stage restarts (below the in-flight lanes)
Event = dict[str, Any]


def stage_pid(pp_rank: int) -> int:
    return 2 + pp_rank


def build_trace(log: ParsedLog, stats: PipelineStats | None = None, source: str = "") -> dict[str, Any]:
    """The whole trace object; `stats` only feeds the top-level metadata."""
    t0 = _first_us(log)
    steps = engine_steps(log)
    placed = _placed_slices(log)
    events = _process_metadata(log, placed, steps)
    timed = _stage_slice_events(placed, t0) + _flow_events(placed, t0) + _engine_events(steps, t0)
    timed += _counter_events(log, t0) + _restart_events(log, t0)
    timed.sort(key=lambda e: e["ts"])  # metadata stays first; stable sort keeps the rest readable
    return {"traceEvents": events + timed, "displayTimeUnit": "ms", "metadata": _metadata(log, stats, t0, source)}


def _first_us(log: ParsedLog) -> int:
    times = [s.start_us for s in log.slices] + [d.t_us for d in log.dispatched] + [c.t_us for c in log.completed]
    times += [c.t_us - round(c.duration_ms * 1e3) for c in log.completed if c.duration_ms is not None]
    times += [r.lost_us for r in log.restarts]
    return min(times, default=0)


def _placed_slices(log: ParsedLog) -> list[tuple[StageSlice, int]]:
    """Every stage slice with its lane (tid) on its stage's track."""
    placed: list[tuple[StageSlice, int]] = []
    for rank in log.pp_ranks:
        mine = log.stage_slices(rank)
        lanes = assign_lanes([(s.start_us, s.end_us) for s in mine])
        placed += zip(mine, lanes)
    return placed


def _process_metadata(log: ParsedLog, placed: list[tuple[StageSlice, int]], steps: list[EngineStep]) -> list[Event]:
    def meta(kind: str, pid: int, tid: int = 0, **args: Any) -> Event:
        return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}

    events = [meta("process_name", ENGINE_PID, name="engine"), meta("process_sort_index", ENGINE_PID, sort_index=0)]
    for lane in sorted(set(_engine_lanes(steps))):
        events.append(meta("thread_name", ENGINE_PID, lane, name=f"in flight #{lane}"))
    if log.restarts:
        events.append(meta("thread_name", ENGINE_PID, RESTART_TID, name="stage restarts"))
    for rank in log.pp_ranks:
        events.append(meta("process_name", stage_pid(rank), name=f"stage {rank}"))
        events.append(meta("process_sort_index", stage_pid(rank), sort_index=1 + rank))
        for lane in sorted({tid for s, tid in placed if s.pp_rank == rank}):
            lane_name = "compute" if lane == 0 else f"overlap #{lane}"
            events.append(meta("thread_name", stage_pid(rank), lane, name=lane_name))
    return events


def _stage_slice_events(placed: list[tuple[StageSlice, int]], t0: int) -> list[Event]:
    return [
        {
            "name": f"step {s.step_id}",
            "cat": "stage",
            "ph": "X",
            "pid": stage_pid(s.pp_rank),
            "tid": tid,
            "ts": s.start_us - t0,
            "dur": s.duration_us,
            "args": {
                "step_id": s.step_id,
                "num_tokens": s.num_tokens,
                "num_reqs": s.num_reqs,
                "handoff_us": s.handoff_us,
            },
        }
        for s, tid in placed
    ]


def _flow_events(placed: list[tuple[StageSlice, int]], t0: int) -> list[Event]:
    # The i-th slice of (stage k, step n) pairs with the i-th of (stage k+1, step n): ids repeat only across runs.
    by_key: defaultdict[tuple[int, int], list[tuple[StageSlice, int]]] = defaultdict(list)
    for s, tid in sorted(placed, key=lambda p: p[0].start_us):
        by_key[(s.pp_rank, s.step_id)].append((s, tid))
    events: list[Event] = []
    flow_id = 0
    for (rank, step_id), sources in sorted(by_key.items()):
        for (src, src_tid), (dst, dst_tid) in zip(sources, by_key.get((rank + 1, step_id), [])):
            flow_id += 1
            common = {"name": "activations", "cat": "handoff", "id": flow_id}
            src_ts = src.end_us - min(1, src.duration_us // 2) - t0
            dst_ts = dst.start_us + min(1, dst.duration_us // 2) - t0
            events.append({**common, "ph": "s", "pid": stage_pid(rank), "tid": src_tid, "ts": src_ts})
            events.append({**common, "ph": "f", "bp": "e", "pid": stage_pid(rank + 1), "tid": dst_tid, "ts": dst_ts})
    return events


def _engine_lanes(steps: list[EngineStep]) -> list[int]:
    # An unfinished step is drawn as an instant; it still takes its lane up to its own start.
    return assign_lanes([(s.start_us, s.end_us if s.end_us is not None else s.start_us) for s in steps])


def _engine_events(steps: list[EngineStep], t0: int) -> list[Event]:
    events: list[Event] = []
    for step, lane in zip(steps, _engine_lanes(steps)):
        args = {
            "step_id": step.step_id,
            "num_reqs": step.num_reqs,
            "num_tokens": step.num_tokens,
            "failed": step.is_failed,
        }
        base = {"cat": "engine", "pid": ENGINE_PID, "tid": lane, "ts": step.start_us - t0, "args": args}
        if step.end_us is None:
            events.append({**base, "name": f"step {step.step_id} (never completed)", "ph": "i", "s": "t"})
        else:
            events.append({**base, "name": f"step {step.step_id}", "ph": "X", "dur": step.end_us - step.start_us})
    return events


def _counter_events(log: ParsedLog, t0: int) -> list[Event]:
    events: list[Event] = []
    for c in sorted(log.completed, key=lambda c: c.t_us):
        counter = {"ph": "C", "pid": ENGINE_PID, "tid": 0, "ts": c.t_us - t0}
        requests = {k: v for k, v in (("running", c.num_running), ("waiting", c.num_waiting)) if v is not None}
        if requests:
            events.append({**counter, "name": "requests", "args": requests})
        if c.kv_usage is not None:
            events.append({**counter, "name": "kv_usage", "args": {"kv_usage": c.kv_usage}})
    return events


def _restart_events(log: ParsedLog, t0: int) -> list[Event]:
    """Each stage restart as a slice on the engine's track, from the loss to serving again."""
    events: list[Event] = []
    for r in log.restarts:
        base = {
            "cat": "recovery", "pid": ENGINE_PID, "tid": RESTART_TID, "ts": r.lost_us - t0,
            "name": f"stage restart: stage(s) {list(r.pp_ranks)} {r.cause}",
            "args": {"pp_ranks": list(r.pp_ranks), "cause": r.cause},
        }  # fmt: skip
        if r.recovered_us is None:
            events.append({**base, "ph": "i", "s": "p", "name": base["name"] + " (never recovered)"})
        else:
            events.append({**base, "ph": "X", "dur": r.recovered_us - r.lost_us})
    return events


def _metadata(log: ParsedLog, stats: PipelineStats | None, t0: int, source: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "source": source,
        "t0_us": t0,  # wall-clock µs since the epoch of ts=0
        "pp_ranks": log.pp_ranks,
        "num_steps": len({s.step_id for s in log.slices}),
        "num_skipped_lines": log.num_skipped,
        "skipped": dict(log.skipped),
    }
    if stats is not None:
        meta["span_us"] = stats.span_us
        meta["mean_bubble_fraction"] = stats.mean_bubble_fraction
        meta["stages"] = [
            {
                "pp_rank": s.pp_rank,
                "busy_us": s.busy_us,
                "busy_fraction": s.busy_fraction,
                "bubble_fraction": s.bubble_fraction,
            }
            for s in stats.stages
        ]
    return meta
