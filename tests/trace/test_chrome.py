"""The Chrome trace built from the synthetic pp=3 log: tracks, slices, lanes, flows, counters."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from asyncpp.trace import build_trace, parse_lines, pipeline_stats
from asyncpp.trace.chrome import ENGINE_PID, stage_pid


@pytest.fixture(scope="module")
def trace(parsed):
    return json.loads(json.dumps(build_trace(parsed, pipeline_stats(parsed), source="run.log")))  # must be plain JSON


def _slices(trace, pid):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def test_top_level_and_process_names(sim, trace):
    assert trace["displayTimeUnit"] == "ms"
    assert trace["metadata"]["num_skipped_lines"] == sim.skipped.total()
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    names = {e["pid"]: e["args"]["name"] for e in meta}
    assert names == {ENGINE_PID: "engine", **{stage_pid(k): f"stage {k}" for k in range(sim.pp_size)}}


def test_timestamps_relative_to_first_event(sim, trace):
    timed = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert min(e["ts"] for e in timed) == 0
    assert trace["metadata"]["t0_us"] == min(sim.dispatch_us)


def test_every_step_on_every_stage(sim, trace):
    for k in range(sim.pp_size):
        events = _slices(trace, stage_pid(k))
        assert sorted(e["args"]["step_id"] for e in events) == list(range(sim.num_steps))
        assert all(e["name"] == f"step {e['args']['step_id']}" for e in events)
        assert set(events[0]["args"]) == {"step_id", "num_tokens", "num_reqs", "handoff_us"}
    t0 = trace["metadata"]["t0_us"]
    got = {(e["pid"], e["args"]["step_id"]): (e["ts"] + t0, e["ts"] + e["dur"] + t0) for e in trace["traceEvents"]
           if e["ph"] == "X" and e["pid"] != ENGINE_PID}
    assert got == {(stage_pid(s.pp_rank), s.step_id): (s.start_us, s.end_us) for s in sim.slices}


def test_no_overlap_within_a_track(trace):
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for key, spans in tracks.items():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), key


def test_engine_steps_in_flight_go_on_separate_lanes(sim, trace):
    events = _slices(trace, ENGINE_PID)
    t0 = trace["metadata"]["t0_us"]
    assert {e["args"]["step_id"]: (e["ts"] + t0, e["ts"] + e["dur"] + t0) for e in events} == {
        n: (sim.dispatch_us[n], sim.complete_us[n]) for n in range(sim.num_steps)
    }
    assert len({e["tid"] for e in events}) > 1  # the simulation keeps several steps in flight


def _binding_slice(trace, flow):
    # The one slice on the flow's (pid, tid) that contains its ts (what a viewer binds it to).
    track = [e for e in _slices(trace, flow["pid"]) if e["tid"] == flow["tid"]]
    hits = [e for e in track if e["ts"] <= flow["ts"] <= e["ts"] + e["dur"]]
    assert len(hits) == 1, flow
    return hits[0]


def test_flows_link_consecutive_stages_of_one_step(sim, trace):
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    finishes = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert len(starts) == len(finishes) == (sim.pp_size - 1) * sim.num_steps
    assert starts.keys() == finishes.keys()
    linked = set()
    for flow_id, s in starts.items():
        f = finishes[flow_id]
        assert f["bp"] == "e" and s["name"] == f["name"] and s["cat"] == f["cat"]
        src, dst = _binding_slice(trace, s), _binding_slice(trace, f)
        assert src["args"]["step_id"] == dst["args"]["step_id"]
        assert dst["pid"] == src["pid"] + 1 and src["pid"] != ENGINE_PID
        linked.add((src["pid"], src["args"]["step_id"]))
    assert linked == {(stage_pid(k), n) for k in range(sim.pp_size - 1) for n in range(sim.num_steps)}


def test_counters_from_step_completed(sim, trace):
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    requests = [e for e in counters if e["name"] == "requests"]
    kv = [e for e in counters if e["name"] == "kv_usage"]
    assert len(requests) == len(kv) == sim.num_steps
    assert all(set(e["args"]) == {"running", "waiting"} for e in requests)
    assert all(0.0 <= e["args"]["kv_usage"] <= 1.0 for e in kv)


def test_overlapping_stage_slices_are_split_into_lanes():
    lines = [json.dumps({"event": "stage_done", "pp_rank": 0, "step_id": n, "start_us": 10 * n, "end_us": 10 * n + 25})
             for n in range(4)]
    trace = build_trace(parse_lines(lines))
    tids = [e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(set(tids)) == 3


def test_unpaired_engine_lines():
    lines = [
        json.dumps({"event": "step_completed", "step_id": 0, "t_us": 5_000, "duration_ms": 2.0}),  # in-process Engine
        json.dumps({"event": "step_dispatched", "step_id": 1, "t_us": 6_000}),  # never completed
        json.dumps({"event": "step_completed", "step_id": 2, "t_us": 7_000}),  # no start known
    ]
    events = [e for e in build_trace(parse_lines(lines))["traceEvents"] if e["pid"] == ENGINE_PID and e["ph"] in "Xi"]
    assert [(e["ph"], e["ts"], e.get("dur")) for e in events] == [("X", 0, 2000), ("i", 3000, None)]
