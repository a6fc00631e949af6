"""`python -m asyncpp.bench.engine_step`: the engine's per-step host time, without a model."""

from __future__ import annotations

import json

from asyncpp.bench import engine_step
from asyncpp.bench.runs import to_toml
from tests.runtime.harness import tiny_sections


def test_times_decode_steps_per_batch_size(tmp_path, tiny_hf_dir, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir)))
    out = tmp_path / "r.json"
    args = ["--config", str(config), "--batch-sizes", "4,16", "--steps", "6", "--input-len", "20", "--result-json", str(out)]
    assert engine_step.main(args) == 0
    results = json.loads(out.read_text())
    assert set(results) == {"4", "16"}
    for r in results.values():
        parts = [r[p] for p in engine_step.PARTS]
        assert all(t > 0 for t in parts) and abs(sum(parts) - r["total"]) < 1e-9
    assert "us/request" in capsys.readouterr().out
