"""The compute section of a run: what the engine's stats say it computed with, and how it is printed."""

from __future__ import annotations

from asyncpp.bench import report
from asyncpp.bench.compute_report import compute_cell, compute_lines, compute_section, weight_mb
from tests.bench.test_kv_report import fake_run

STATS = {
    "num_running": 0, "cpu_model": "AMD EPYC 9R14", "isa": "avx2", "best_isa": "avx512_bf16", "dtype": "float32",
    "weight_format": "float", "reason": "float32: no native bfloat16 at cpu_isa = avx2; bf16 matmul would run on a slow path",
    "cpu_features": {"avx2": True}, "weight_bytes_per_stage": [64_123_456, 70_300_000],
}


def test_section_from_stats():
    section = compute_section(STATS)
    assert section["isa"] == "avx2" and section["best_isa"] == "avx512_bf16" and section["dtype"] == "float32"
    assert section["weight_bytes_per_stage"] == [64_123_456, 70_300_000]
    assert section["weight_mb_per_stage"] == [64.12, 70.3]
    assert compute_section({"num_running": 0}) is None  # an engine that reports no plan


def test_lines_and_cells():
    section = compute_section(STATS)
    lines = compute_lines(section)
    assert lines[0].startswith("CPU:") and lines[0].endswith("AMD EPYC 9R14")
    assert lines[1].endswith("avx2 / avx512_bf16") and lines[2].endswith("float32 / float")
    assert lines[3].startswith("Resident weights per stage (MB):") and lines[3].endswith("64.1 / 70.3")
    assert lines[4] == f"  {STATS['reason']}"
    assert compute_cell(section) == "avx2 / float32 / float" and weight_mb(section) == "64.1 / 70.3"
    assert compute_cell(None) == "-" and weight_mb(None) == "-"


def test_run_block_and_summary_show_the_compute_section_when_present():
    run = fake_run("avx2", None, ttft_split=False) | {"compute": compute_section(STATS)}
    block = report.run_block(run)
    assert " Compute " in block and "ISA used / best:" in block and "avx2 / avx512_bf16" in block
    table = report.summary_table({"runs": [run]})
    assert "isa / dtype / weights" in table and "avx2 / float32 / float" in table and "64.1 / 70.3" in table
    plain = fake_run("old", None, ttft_split=False)
    assert " Compute " not in report.run_block(plain) and "isa / dtype" not in report.summary_table({"runs": [plain]})
