"""The tables of a data-parallel probe (`scripts/dp_probe.sh`), from `load.py` JSON files made up here."""

from __future__ import annotations

import json

import pytest

from asyncpp.bench.dp_probe_table import dp_runs, main, merged


def write(out, name, workload, rnd, tok_s, duration_s, completed, tpot, ttft, p99):
    fields = {"output_tok_s": tok_s, "duration_s": duration_s, "completed": completed, "tpot_ms_mean": tpot,
              "ttft_ms_mean": ttft, "ttft_ms_p99": p99}  # fmt: skip
    (out / f"{name}-c{workload}-r{rnd}.json").write_text(json.dumps(fields))


def test_a_split_run_counts_as_one_and_is_never_flattered():
    one = merged([
        {"output_tok_s": 100.0, "duration_s": 10.0, "completed": 30, "tpot_ms_mean": 20.0, "ttft_ms_mean": 300.0, "ttft_ms_p99": 900.0},
        {"output_tok_s": 90.0, "duration_s": 12.0, "completed": 10, "tpot_ms_mean": 40.0, "ttft_ms_mean": 100.0, "ttft_ms_p99": 500.0},
    ])  # fmt: skip
    assert one["output_tok_s"] == pytest.approx((1000 + 1080) / 12)  # both halves' tokens over the longer half
    assert one["tpot_ms_mean"] == pytest.approx((30 * 20 + 10 * 40) / 40)  # over all requests
    assert one["ttft_ms_mean"] == pytest.approx((30 * 300 + 10 * 100) / 40)
    assert one["ttft_ms_p99"] == 900.0  # the larger half's


def test_c1_is_the_first_engine_alone_and_a_half_missing_drops_its_round(tmp_path):
    write(tmp_path, "dp2a", 1, 1, 50.0, 10.0, 16, 8.0, 90.0, 120.0)
    write(tmp_path, "dp2b", 1, 1, 999.0, 1.0, 16, 1.0, 1.0, 1.0)  # never read: c1 has no second half
    assert dp_runs(tmp_path, 1)[1]["tpot_ms_mean"] == 8.0
    for rnd in (1, 2):
        write(tmp_path, "dp2a", 16, rnd, 200.0, 10.0, 32, 30.0, 400.0, 700.0)
    write(tmp_path, "dp2b", 16, 2, 220.0, 10.0, 32, 28.0, 380.0, 650.0)
    assert list(dp_runs(tmp_path, 16)) == [2]
    assert dp_runs(tmp_path, 16)[2]["output_tok_s"] == pytest.approx(420.0)


def test_tables_give_each_ratio_per_round(tmp_path, capsys):
    for rnd, vllm in ((1, 300.0), (2, 250.0)):
        write(tmp_path, "vllm", 16, rnd, vllm, 10.0, 64, 40.0, 800.0, 900.0)
        write(tmp_path, "pp2", 16, rnd, 400.0, 10.0, 64, 30.0, 500.0, 800.0)
        write(tmp_path, "dp2a", 16, rnd, 250.0, 10.0, 32, 25.0, 450.0, 700.0)
        write(tmp_path, "dp2b", 16, rnd, 250.0, 10.0, 32, 25.0, 450.0, 720.0)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| dp2 | c16 | 500.0 (25.00), 500.0 (25.00) |" in out
    assert "| c16 output, dp2 / pp2 | 1.25x [1.25x-1.25x] | 1.25x, 1.25x |" in out
    assert "| c16 output, dp2 / vllm | 1.83x [1.67x-2.00x] | 1.67x, 2.00x |" in out
    assert "| c64 |" not in out and "| long |" not in out and "c64 output" not in out  # no files, no rows
    assert (tmp_path / "table.md").read_text() == out


def test_main_refuses_anything_but_a_directory(tmp_path, capsys):
    assert main([]) == 2
    assert main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == "usage: python -m asyncpp.bench.dp_probe_table OUT_DIR (a directory)\n" * 2


def test_the_whole_table_of_one_round_with_every_workload(tmp_path, monkeypatch, capsys):
    for name, scale in (("vllm", 1.0), ("pp2", 2.0), ("dp2a", 1.25), ("dp2b", 1.25)):
        for w in (1, 16, 64):
            write(tmp_path, name, w, 1, 100.0 * scale, 10.0, 8, 10.0 / scale, 100.0, 200.0)
        write(tmp_path, name, "long", 1, 5.0, 10.0, 8, 50.0, 1000.0 / scale, 2000.0 / scale)
    monkeypatch.setattr("sys.argv", ["dp_probe_table", str(tmp_path)])  # the command line when no argv is given
    assert main() == 0
    assert capsys.readouterr().out == "\n".join([
        "| server | workload | per round: output tok/s (mean TPOT ms); long: mean / p99 TTFT ms |",
        "| --- | --- | --- |",
        "| vllm | c1 | 100.0 (10.00) |", "| vllm | c16 | 100.0 (10.00) |", "| vllm | c64 | 100.0 (10.00) |",
        "| vllm | long | 1000 / 2000 |",
        "| pp2 | c1 | 200.0 (5.00) |", "| pp2 | c16 | 200.0 (5.00) |", "| pp2 | c64 | 200.0 (5.00) |",
        "| pp2 | long | 500 / 1000 |",
        "| dp2 | c1 | 125.0 (8.00) |", "| dp2 | c16 | 250.0 (8.00) |", "| dp2 | c64 | 250.0 (8.00) |",
        "| dp2 | long | 800 / 1600 |",
        "",
        "| ratio | median [range] | rounds |",
        "| --- | ---: | --- |",
        "| c16 output, dp2 / pp2 | 1.25x [1.25x-1.25x] | 1.25x |",
        "| c16 output, dp2 / vllm | 2.50x [2.50x-2.50x] | 2.50x |",
        "| c16 output, pp2 / vllm | 2.00x [2.00x-2.00x] | 2.00x |",
        "| c64 output, dp2 / pp2 | 1.25x [1.25x-1.25x] | 1.25x |",
        "| c64 output, dp2 / vllm | 2.50x [2.50x-2.50x] | 2.50x |",
        "| c64 output, pp2 / vllm | 2.00x [2.00x-2.00x] | 2.00x |",
        "| c1 TPOT, dp2 / pp2 | 1.60x [1.60x-1.60x] | 1.60x |",
        "| long mean TTFT, dp2 / vllm | 0.80x [0.80x-0.80x] | 0.80x |",
        "| long mean TTFT, pp2 / vllm | 0.50x [0.50x-0.50x] | 0.50x |",
        "| long p99 TTFT, dp2 / vllm | 0.80x [0.80x-0.80x] | 0.80x |",
        "| long p99 TTFT, pp2 / vllm | 0.50x [0.50x-0.50x] | 0.50x |",
    ]) + "\n"  # fmt: skip
