"""Stage restarts in the trace: `stage_lost` .. `stage_recovered` parsed, drawn on the engine's track."""

from __future__ import annotations

import json

from asyncpp.trace import build_trace, parse_lines, pipeline_stats
from asyncpp.trace.chrome import ENGINE_PID, RESTART_TID
from asyncpp.trace.records import StageRestart


def _line(t_us: int, event: str, **fields) -> str:
    return json.dumps({"event": event, "t_us": t_us, "role": "engine", **fields})


def _stage_done(step_id: int, pp_rank: int, start_us: int, end_us: int) -> str:
    return json.dumps(
        {"event": "stage_done", "role": "stage", "pp_rank": pp_rank, "step_id": step_id, "start_us": start_us, "end_us": end_us}
    )


LINES = [
    _stage_done(0, 0, 1_000, 2_000),
    _line(5_000, "stage_lost", pp_ranks=[1], cause="exited"),
    _line(5_100, "recovery_requeued", num_requests=3),
    _line(9_000, "stage_recovered", recovery_s=0.004),
    _stage_done(1, 0, 9_500, 10_000),
    _line(12_000, "stage_lost", pp_ranks=[0, 1], cause="hung"),
    _line(12_500, "stage_recovered"),
    _line(20_000, "stage_lost", pp_ranks=[1], cause="exited"),  # the log ends before it recovers
    _line(21_000, "stage_recovered", pp_ranks="x"),
    _line(22_000, "stage_recovered"),  # no restart open: a bad line
    _line(23_000, "stage_lost", pp_ranks="1"),  # not a list: a bad line
]


def test_restarts_are_parsed_from_loss_to_recovery():
    log = parse_lines(LINES)
    assert log.restarts == [
        StageRestart(5_000, (1,), "exited", 9_000),
        StageRestart(12_000, (0, 1), "hung", 12_500),
        StageRestart(20_000, (1,), "exited", 21_000),
    ]
    assert log.skipped["bad_fields"] == 2 and log.num_other == 1


def test_each_restart_is_a_slice_on_the_engine_track():
    log = parse_lines(LINES[:8])
    trace = json.loads(json.dumps(build_trace(log, pipeline_stats(log))))
    restarts = [e for e in trace["traceEvents"] if e.get("cat") == "recovery"]
    t0 = trace["metadata"]["t0_us"]
    assert t0 == 1_000
    assert [(e["ph"], e["ts"], e.get("dur"), e["args"]["pp_ranks"]) for e in restarts] == [
        ("X", 4_000, 4_000, [1]),
        ("X", 11_000, 500, [0, 1]),
        ("i", 19_000, None, [1]),
    ]
    assert all(e["pid"] == ENGINE_PID and e["tid"] == RESTART_TID for e in restarts)
    assert restarts[2]["name"].endswith("(never recovered)") and "hung" in restarts[1]["name"]
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["tid"] == RESTART_TID]
    assert [e["args"]["name"] for e in names] == ["stage restarts"]


def test_a_log_without_restarts_has_no_restart_track():
    log = parse_lines(LINES[:1])
    trace = build_trace(log, pipeline_stats(log))
    assert not [e for e in trace["traceEvents"] if e.get("cat") == "recovery" or e.get("tid") == RESTART_TID]


def test_the_summary_figure_shades_the_restarts(tmp_path):
    from asyncpp.trace.plot import render_summary_png

    log = parse_lines(LINES[:8])
    render_summary_png(log, pipeline_stats(log), tmp_path / "summary.png")
    assert (tmp_path / "summary.png").stat().st_size > 1000
