"""The tables of a peers sitting, from the JSON files `load.py` leaves (made up here)."""

from __future__ import annotations

import json
import sys

import pytest

from asyncpp.bench.peers_table import main, per_round, read_runs, spread, tables


def write(out, name, workload, rnd, **fields):
    path = out / (f"{name}-c{workload}.json" if rnd == 1 else f"{name}-c{workload}-r{rnd}.json")
    path.write_text(json.dumps(fields))


def test_read_runs_finds_every_round_by_its_file_name(tmp_path):
    write(tmp_path, "llamacpp", 16, 1, output_tok_s=1.0)
    write(tmp_path, "llamacpp", 16, 3, output_tok_s=3.0)
    write(tmp_path, "llamacpp", 64, 2, output_tok_s=9.0)  # another workload
    write(tmp_path, "llamacpp", 1, 2, output_tok_s=9.0)  # c1 is not c16's prefix
    assert {r: d["output_tok_s"] for r, d in read_runs(tmp_path, "llamacpp", 16).items()} == {1: 1.0, 3: 3.0}
    assert read_runs(tmp_path, "vllm-bfloat16", 16) == {}


def test_per_round_divides_by_the_chosen_peer_in_the_same_round_only():
    mine = {1: {"x": 10.0}, 2: {"x": 20.0}, 3: {"x": 30.0}}
    a = {1: {"x": 5.0}, 2: {"x": 40.0}}
    b = {1: {"x": 4.0}, 3: {"x": 10.0}}
    assert per_round(mine, [a, b], "x", max) == [2.0, 0.5, 3.0]
    assert per_round(mine, [a, b], "x", min) == [2.5, 0.5, 3.0]
    assert per_round(mine, [{}], "x", max) == []  # no round with both sides


def test_spread_gives_the_median_and_the_range():
    assert spread([1.5, 1.0, 1.25]) == "1.25x [1.00x-1.50x]"
    assert spread([]) == "-"


def sitting(out):
    """Two rounds: the default beats vLLM by 1.5x and 1.2x at c16, one stage is slower."""
    for rnd, (vllm, auto, one) in enumerate([(200.0, 300.0, 270.0), (250.0, 300.0, 330.0)], start=1):
        for c in (1, 16, 64):
            write(out, "vllm-bfloat16", c, rnd, output_tok_s=vllm, tpot_ms_mean=40.0)
            write(out, "llamacpp", c, rnd, output_tok_s=50.0, tpot_ms_mean=10.0)
            write(out, "asyncpp-auto", c, rnd, output_tok_s=auto, tpot_ms_mean=8.0 * rnd)
            write(out, "asyncpp-pp1", c, rnd, output_tok_s=one, tpot_ms_mean=6.0)
        write(out, "vllm-bfloat16", "long", rnd, ttft_ms_mean=2000.0, ttft_ms_p99=4000.0, total_tok_s=1000.0)
        write(out, "llamacpp", "long", rnd, ttft_ms_mean=9000.0, ttft_ms_p99=12000.0, total_tok_s=300.0)
        write(out, "asyncpp-auto", "long", rnd, ttft_ms_mean=1500.0 * rnd, ttft_ms_p99=3000.0, total_tok_s=1100.0)
        write(out, "asyncpp-pp1", "long", rnd, ttft_ms_mean=3000.0, ttft_ms_p99=3500.0, total_tok_s=900.0)


def test_the_targets_are_ratios_within_each_round(tmp_path):
    sitting(tmp_path)
    text = tables(tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["c1: TPOT / llama.cpp's (target: at most 1)"].endswith("| 0.80x, 1.60x |")
    assert rows["c16: output / the faster peer's (target: 1.3)"] == (
        "| c16: output / the faster peer's (target: 1.3) | 1.35x [1.20x-1.50x] | 1.50x, 1.20x |"
    )
    assert rows["long: mean TTFT / the faster peer's (target: at most 1)"].endswith("| 0.75x, 1.50x |")
    assert rows["long: p99 TTFT / the faster peer's (target: at most 1)"].endswith("| 0.75x, 0.75x |")
    assert rows["one stage / default: c1 TPOT"].endswith("| 0.75x, 0.38x |")
    assert rows["one stage / default: c64 output"].endswith("| 0.90x, 1.10x |")
    assert rows["one stage / default: long mean TTFT"].endswith("| 2.00x, 1.00x |")
    throughput = "| asyncpp-auto | " + " | ".join(["300.0 (12.0) [300.0-300.0]"] * 3) + " |"
    assert throughput in text  # medians of the rounds: output tok/s (mean TPOT) [range]
    assert "| asyncpp-pp1 | 300.0 (6.0) [270.0-330.0] |" in text
    assert "| vllm-float32 | - | - | - |" in text  # skipped in this sitting
    assert "| asyncpp-auto | 2250 | 3000 | 1100 |" in text  # long prompts: medians of the rounds


def test_a_sitting_without_the_long_workload_or_the_default_leaves_those_tables_out(tmp_path):
    write(tmp_path, "llamacpp", 16, 1, output_tok_s=50.0, tpot_ms_mean=10.0)
    text = tables(tmp_path)
    assert "| llamacpp | - | 50.0 (10.0) | - |" in text
    assert "long prompts" not in text and "per round" not in text


def test_main_prints_and_keeps_the_tables(tmp_path, capsys):
    sitting(tmp_path)
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed == (tmp_path / "table.md").read_text() == tables(tmp_path)


def test_the_tables_have_their_headers_and_a_blank_line_between_them(tmp_path):
    sitting(tmp_path)
    lines = tables(tmp_path).splitlines()
    heads = [
        "output tok/s (mean TPOT ms), 64 words in, 64 tokens out, ignore_eos; median [range] of the rounds:",
        "long prompts (1000 words in, 16 out, concurrency 4): TTFT mean, p99 (ms), total tok/s; median of rounds:",
        ("asyncpp's default against the targets; one stage with two threads, one engine of two stages, "
         "and the replicas alone, against it and the peers:"),
    ]
    starts = [lines.index(head) for head in heads]
    assert starts[0] == 0 and all(lines[i - 1] == "" for i in starts[1:])
    assert lines[1:3] == ["| server | c1 | c16 | c64 |", "| --- | ---: | ---: | ---: |"]
    assert lines[starts[1] + 1 : starts[1] + 3] == ["| server | TTFT mean | TTFT p99 | total tok/s |", "| --- | ---: | ---: | ---: |"]
    assert lines[starts[2] + 1 : starts[2] + 3] == ["| per round | median [range] | rounds |", "| --- | ---: | --- |"]


def test_one_target_with_rounds_on_both_sides_gets_its_table(tmp_path):
    write(tmp_path, "llamacpp", 1, 1, output_tok_s=50.0, tpot_ms_mean=10.0)
    write(tmp_path, "asyncpp-auto", 1, 1, output_tok_s=100.0, tpot_ms_mean=9.0)
    rows = [line for line in tables(tmp_path).splitlines() if line.startswith("| c1")]
    assert rows == ["| c1: TPOT / llama.cpp's (target: at most 1) | 0.90x [0.90x-0.90x] | 0.90x |"]


def test_main_reads_the_directory_from_the_command_line(tmp_path, monkeypatch, capsys):
    sitting(tmp_path)
    monkeypatch.setattr(sys, "argv", ["peers_table", str(tmp_path)])
    assert main() == 0
    assert capsys.readouterr().out == tables(tmp_path)


@pytest.mark.parametrize(
    "args, why",
    [([], "usage: python -m asyncpp.bench.peers_table OUT_DIR"), (["a", "b"], "usage:"),
     (["/nonexistent/sitting"], "/nonexistent/sitting is not a directory")],
)  # fmt: skip
def test_main_refuses_anything_but_one_directory(args, why, capsys):
    assert main(args) == 2
    assert why in capsys.readouterr().err
