"""The parser: typed records from the synthetic log, exact skipped-line counts, tolerance of odd fields."""

from __future__ import annotations

import json
import random

from asyncpp.trace import StageSlice, parse_lines, parse_log
from tests.trace.log_gen import simulate


def test_records_match_simulation(sim, parsed):
    assert parsed.pp_ranks == list(range(sim.pp_size))
    got = {(s.pp_rank, s.step_id): (s.start_us, s.end_us) for s in parsed.slices}
    assert got == {(s.pp_rank, s.step_id): (s.start_us, s.end_us) for s in sim.slices}
    assert [d.t_us for d in parsed.dispatched] == sim.dispatch_us
    assert [c.t_us for c in parsed.completed] == sim.complete_us
    assert all(c.kv_usage is not None and c.num_running is not None for c in parsed.completed)
    assert all(s.handoff_us > 0 for s in parsed.slices if s.pp_rank < sim.pp_size - 1)


def test_skipped_lines_counted_by_reason(sim, parsed):
    assert sim.skipped.total() == 7  # the injection itself: 6 bad lines + the truncated last one
    assert parsed.skipped == sim.skipped
    assert parsed.num_skipped == sim.skipped.total()
    assert parsed.num_blank == 2


def test_clean_log_skips_nothing():
    log = parse_lines(simulate(pp_size=2, num_steps=5).lines)
    assert log.num_skipped == 0 and len(log.slices) == 10


def test_optional_fields_default_and_extra_fields_ignored():
    line = {"event": "stage_done", "role": "stage", "pp_rank": 1, "step_id": 7, "start_us": 100, "end_us": 250,
            "something_new": {"nested": [1, 2]}, "num_tokens": None}
    log = parse_lines([json.dumps(line)])
    assert log.slices == [StageSlice(pp_rank=1, step_id=7, start_us=100, end_us=250)]
    done = parse_lines([json.dumps({"event": "step_completed", "step_id": 3, "t_us": 5})])
    assert done.completed[0].num_running is None and done.completed[0].kv_usage is None


def test_mistyped_required_fields_are_skipped_not_raised():
    base = {"event": "stage_done", "pp_rank": 0, "step_id": 1, "start_us": 10, "end_us": 20}
    bad_values = [("start_us", True), ("end_us", "20"), ("step_id", 1.5), ("end_us", 5), ("pp_rank", [0])]
    lines = [json.dumps({**base, key: value}) for key, value in bad_values]
    lines += ['{"event": "stage_done", "pp_rank": 0, "step_id": 1, "start_us": NaN, "end_us": 20}']
    lines += [json.dumps({k: v for k, v in base.items() if k != "end_us"}), json.dumps({"event": ["stage_done"]})]
    log = parse_lines(lines)
    assert log.slices == [] and log.skipped["bad_fields"] == 7 and log.num_other == 1


def test_integral_floats_accepted():
    line = {"event": "stage_done", "pp_rank": 0.0, "step_id": 2.0, "start_us": 1e3, "end_us": 2e3}
    log = parse_lines([json.dumps(line)])
    assert log.slices == [StageSlice(0, 2, 1000, 2000)]


def test_engine_step_failed_recorded_stage_one_ignored():
    log = parse_lines([
        json.dumps({"event": "step_failed", "role": "stage", "pp_rank": 1, "step_id": 4, "error": "boom"}),
        json.dumps({"event": "step_failed", "role": "engine", "step_id": 5, "errors": ["boom"]}),
    ])
    assert log.failed_step_ids == {5}


def test_line_order_does_not_matter(sim):
    shuffled = list(sim.lines[:-1])  # keep the truncated line out: shuffling it mid-file changes nothing anyway
    random.Random(3).shuffle(shuffled)
    a, b = parse_lines(sim.lines[:-1]), parse_lines(shuffled)
    def key(s):
        return (s.pp_rank, s.step_id)

    assert sorted(a.slices, key=key) == sorted(b.slices, key=key)
    assert a.skipped == b.skipped


def test_undecodable_bytes_do_not_crash(tmp_path):
    path = tmp_path / "binary.log"
    good = json.dumps({"event": "stage_done", "pp_rank": 0, "step_id": 0, "start_us": 1, "end_us": 2}).encode()
    path.write_bytes(b"\xff\xfe\x00garbage\n" + good + b"\n\x80\x81{\n")
    log = parse_log(path)
    assert len(log.slices) == 1 and log.skipped["not_json"] == 2
