"""The CLI end to end: trace JSON, printed summary, and a PNG that reads back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncpp.trace.__main__ import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = path.read_bytes()
    assert len(data) > 0 and data[:8] == PNG_SIGNATURE
    image = pytest.importorskip("matplotlib.image").imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    return image


def test_cli_writes_trace_summary_and_png(sim, log_path, tmp_path, capsys):
    out, png = tmp_path / "trace.json", tmp_path / "summary.png"
    assert main([str(log_path), "-o", str(out), "--png", str(png)]) == 0
    trace = json.loads(out.read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == (sim.pp_size + 1) * sim.num_steps
    printed = capsys.readouterr().out
    assert f"{sim.num_steps} steps on {sim.pp_size} stages" in printed
    assert f"{sim.skipped.total()} lines skipped" in printed
    image = _assert_png(png)
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_log_without_stage_slices(tmp_path, capsys):
    log = tmp_path / "engine_only.log"
    # Garbage, an unused event, and a step_completed cut short: 2 skipped lines, no slices.
    log.write_text('INFO hello\n{"event": "engine_ready", "role": "engine"}\n{"event": "step_completed", "step_id": 0')
    out, png = tmp_path / "trace.json", tmp_path / "empty.png"
    assert main([str(log), "-o", str(out), "--png", str(png)]) == 0
    trace = json.loads(out.read_text())
    assert not [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert trace["metadata"]["num_skipped_lines"] == 2
    assert "no stage_done lines" in capsys.readouterr().out
    _assert_png(png)


def test_missing_log_file_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main([str(tmp_path / "absent.log"), "-o", str(tmp_path / "t.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_python_dash_m(log_path, tmp_path):
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "asyncpp.trace", str(log_path), "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "mean bubble fraction" in proc.stdout and json.loads(out.read_text())["traceEvents"]
