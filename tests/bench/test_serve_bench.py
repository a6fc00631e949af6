"""`python -m asyncpp.bench` end to end on the tiny random model: two engine runs, one JSON file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from asyncpp.bench import serve
from asyncpp.bench.datasets import random_requests
from asyncpp.bench.engine_proc import launched_engine
from asyncpp.bench.metrics import RATIO_METRICS
from asyncpp.kernels.isa import cpu_info
from tests.conftest import has_transformers
from tests.runtime.conftest import wait_until
from tests.runtime.harness import pid_alive, shm_segments, tiny_sections, to_toml

NUM_PROMPTS = 12
OUTPUT_LEN = 8
METRIC_KEYS = [
    "num_requests", "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
    "num_itl_samples", "request_throughput", "output_throughput", "total_token_throughput",
] + [f"{s}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p99")]


@pytest.fixture(scope="module")
def tiny_toml(tmp_path_factory, tiny_hf_dir) -> Path:
    path = tmp_path_factory.mktemp("bench") / "tiny.toml"
    path.write_text(to_toml(tiny_sections(tiny_hf_dir, 2)))
    return path


@pytest.fixture(scope="module")
def result(tiny_toml, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out") / "result.json"
    argv = [
        "--config", str(tiny_toml), "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4",
        "--random-input-len", "12", "--random-output-len", str(OUTPUT_LEN), "--runs", "pp=2;pp=1",
        "--result-json", str(out),
    ]
    assert serve.main(argv) == 0
    return json.loads(out.read_text())


def test_json_has_args_machine_runs(result):
    assert result["args"]["num_prompts"] == NUM_PROMPTS and result["args"]["request_rate"] == "inf"
    assert {"cpu_count", "torch_version", "timestamp"} <= set(result["machine"])
    assert [r["label"] for r in result["runs"]] == ["pp=2", "pp=1"]
    assert result["baseline"] == "pp=2"
    assert [r["pp_size"] for r in result["runs"]] == [2, 1]
    for run in result["runs"]:
        assert set(METRIC_KEYS) <= set(run["metrics"])
        assert all(run["metrics"][k] is not None for k in METRIC_KEYS), run["metrics"]


def test_json_has_what_each_engine_computed_with(result):
    best = cpu_info().best_level
    assert result["machine"]["best_isa"] == best and result["machine"]["cpu_model"] == cpu_info().model_name
    for run in result["runs"]:
        compute = run["compute"]
        assert (compute["isa"], compute["best_isa"], compute["dtype"], compute["weight_format"]) == (
            best, best, "float32", "native"
        )
        assert compute["cpu_model"] == cpu_info().model_name and compute["reason"]
        assert run["dtype"] == "float32"  # the resolved one, as the memcpy reference uses it
        assert len(compute["weight_bytes_per_stage"]) == run["pp_size"]
        assert all(n > 0 for n in compute["weight_bytes_per_stage"]) and all(mb > 0 for mb in compute["weight_mb_per_stage"])


def test_every_request_completed_with_its_output_length(result):
    for run in result["runs"]:
        m = run["metrics"]
        assert m["completed"] == NUM_PROMPTS and m["failed"] == 0
        assert m["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos is on by default
        assert m["total_input_tokens"] > 0
        assert m["request_throughput"] > 0 and m["output_throughput"] > 0
        assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])


def test_percentiles_ordered_and_itl_consistent(result):
    for run in result["runs"]:
        m, reqs = run["metrics"], run["requests"]
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < m[f"p50_{name}_ms"] <= m[f"p99_{name}_ms"], name
        num_itl = sum(len(r["itl_s"]) for r in reqs)
        assert num_itl == m["num_itl_samples"] == sum(r["num_chunks"] - 1 for r in reqs)
        # One gap per token-carrying delta after the first: at most one per token after the first.
        assert num_itl <= m["total_output_tokens"] - m["completed"]
        for r in reqs:
            assert r["num_output_tokens"] == OUTPUT_LEN and r["ttft_s"] <= r["e2e_s"]
            assert r["ttft_s"] + sum(r["itl_s"]) == pytest.approx(r["e2e_s"], abs=0.05)


def test_stage_figures(result):
    for run in result["runs"]:
        st = run["stages"]
        assert len(st["busy_fraction"]) == run["pp_size"]
        assert all(0.0 <= b <= 1.0 for b in st["busy_fraction"]), st
        assert st["num_steps"] > 0
        assert len(st["handoff_us_p50"]) == run["pp_size"] - 1
        for p50, p99 in zip(st["handoff_us_p50"], st["handoff_us_p99"]):
            assert 0 < p50 <= p99
        for kind in ("decode", "prefill"):
            assert run["memcpy"][kind]["nbytes"] > 0 and 0 < run["memcpy"][kind]["p50_us"] <= run["memcpy"][kind]["p99_us"]


def test_ratios_come_from_the_numbers_in_the_file(result):
    runs = {r["label"]: r["metrics"] for r in result["runs"]}
    rows = result["ratios"]
    assert len(rows) == len(RATIO_METRICS)
    for row in rows:
        assert (row["subject"], row["reference"]) == ("pp=1", "pp=2")  # the other run / the baseline (the first)
        expected = runs["pp=1"][row["metric"]] / runs["pp=2"][row["metric"]]
        assert row["ratio"] == pytest.approx(expected)


def test_repeat_interleaves_runs_and_summarises_ratios_per_repetition(tiny_toml, tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = [
        "--config", str(tiny_toml), "--num-prompts", "4", "--max-concurrency", "4", "--random-input-len", "8",
        "--random-output-len", "4", "--runs", "pp=1;pp=2", "--repeat", "2", "--result-json", str(out),
    ]
    assert serve.main(argv) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [r["label"] for r in runs] == ["pp=1 #1", "pp=2 #1", "pp=1 #2", "pp=2 #2"]
    assert [(r["variant"], r["repeat"]) for r in runs] == [("pp=1", 1), ("pp=2", 1), ("pp=1", 2), ("pp=2", 2)]
    assert result["baseline"] == "pp=1"
    metrics = {r["label"]: r["metrics"] for r in runs}
    rows = result["ratios"]
    assert len(rows) == 2 * len(RATIO_METRICS)
    for row in rows:  # each ratio within one repetition
        assert (row["subject"], row["reference"]) == (f"pp=2 #{row['repeat']}", f"pp=1 #{row['repeat']}")
        assert row["ratio"] == pytest.approx(metrics[row["subject"]][row["metric"]] / metrics[row["reference"]][row["metric"]])
    summary = {row["metric"]: row for row in result["ratio_summary"]}
    assert len(summary) == len(RATIO_METRICS)
    tput = summary["output_throughput"]
    per_rep = [r["ratio"] for r in rows if r["metric"] == "output_throughput"]
    assert (tput["subject"], tput["reference"], tput["ratios"]) == ("pp=2", "pp=1", per_rep)
    assert tput["median"] == pytest.approx(sum(per_rep) / 2)
    assert (tput["min"], tput["max"]) == (min(per_rep), max(per_rep))
    assert "Over 2 repetitions" in capsys.readouterr().out


def test_unknown_baseline_fails_before_any_engine_starts(tiny_toml, capsys):
    argv = [
        "--config", str(tiny_toml), "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2",
        "--runs", "pp=1;pp=2", "--baseline", "pp=3",
    ]
    assert serve.main(argv) == 1
    captured = capsys.readouterr()
    assert "--baseline 'pp=3' names no run" in captured.err
    assert "Serving benchmark" not in captured.out  # no run was measured


def test_engines_are_gone(result):
    for run in result["runs"]:
        engine = run["engine"]
        assert engine["exit_code"] == 0
        assert len(engine["stage_pids"]) == run["pp_size"]
        assert not any(pid_alive(pid) for pid in [engine["pid"], *engine["stage_pids"]])
        assert not [name for name in shm_segments() if engine["run_id"] in name]


def test_interrupt_stops_the_engine(tiny_toml):
    pids = []
    with pytest.raises(KeyboardInterrupt):
        with launched_engine(tiny_toml) as engine:
            pids = [engine.pid, *_children(engine.pid)]
            raise KeyboardInterrupt
    assert len(pids) >= 3  # the launcher and its two stages
    assert engine.proc.returncode == 0
    # The stages are reaped before the launcher exits; multiprocessing's resource tracker
    # (also its child) exits when it sees the launcher gone, a moment later.
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), 5, "every process of the engine exits")


@pytest.mark.skipif(not has_transformers(), reason="transformers is not installed")
def test_transformers_reference_counts_requested_tokens(tiny_hf_dir):
    from asyncpp.bench.hf_compare import compare

    requests = random_requests(5, 8, 6, range_ratio=0.5, seed=2)
    results = compare(requests, [2, 5], source="hf", path=str(tiny_hf_dir), dtype="float32", num_threads=1)
    assert [r.batch_size for r in results] == [2, 5]
    for r in results:
        assert r.total_output_tokens == sum(q.output_len for q in requests)
        assert r.output_throughput == pytest.approx(r.total_output_tokens / r.duration_s)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_cpu_figures_cover_engine_client_and_stages(result):
    for run in result["runs"]:
        cpu, window_s = run["cpu"], run["stages"]["window_s"]
        num_tokens = run["metrics"]["total_output_tokens"]
        assert cpu["num_output_tokens"] == num_tokens
        assert len(cpu["stages"]) == run["pp_size"]
        for figures in [cpu["engine"], cpu["client"], *cpu["stages"], cpu["machine_busy"]]:
            # Stages are read from /proc in clock ticks (10 ms): one that computed less than a tick
            # in a short window reads 0, so only their sum must be above it.
            is_stage = any(figures is stage for stage in cpu["stages"])
            assert (0 <= figures["cpu_s"] if is_stage else 0 < figures["cpu_s"]), figures
            assert figures["cpu_s"] < (os.cpu_count() + 1) * window_s, figures
            assert figures["cpu_us_per_output_token"] == pytest.approx(figures["cpu_s"] * 1e6 / num_tokens)
        assert sum(stage["cpu_s"] for stage in cpu["stages"]) > 0
        assert cpu["engine"]["core_pct"] == pytest.approx(100 * cpu["engine"]["cpu_s"] / window_s)
