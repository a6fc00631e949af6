"""The KV connector section of a run: window deltas, GB/s, memcpy reference, and how it is printed."""

from __future__ import annotations

import pytest

from asyncpp.bench import report
from asyncpp.bench.kv_report import MIN_MEMCPY_BYTES, kv_deltas, kv_lines, kv_section
from asyncpp.bench.metrics import RequestRecord, ratio_rows, serving_metrics

SCHEDULER = {"num_prefix_cache_queries_tokens": 1000, "num_prefix_cache_hit_tokens": 100,
             "num_external_prefix_hit_tokens": 0, "num_failed_load_tokens": 0}
BEFORE = SCHEDULER | {
    "kv_connector": "offload", "kv_blocks_loaded": 4, "kv_blocks_saved": 10, "kv_bytes_loaded": 1_000_000,
    "kv_bytes_saved": 3_000_000, "kv_load_time_s": 0.5, "kv_save_time_s": 1.0,
}
AFTER = BEFORE | {
    "num_prefix_cache_queries_tokens": 5096, "num_prefix_cache_hit_tokens": 228,
    "num_external_prefix_hit_tokens": 3072, "num_failed_load_tokens": 16,
    "kv_blocks_loaded": 100, "kv_blocks_saved": 110, "kv_bytes_loaded": 71_000_000, "kv_bytes_saved": 203_000_000,
    "kv_load_time_s": 0.514, "kv_save_time_s": 1.05,
}


def test_deltas_over_the_window_and_rates():
    kv = kv_deltas(BEFORE, AFTER)
    assert kv["connector"] == "offload"
    hits = (kv["num_external_hit_tokens"], kv["num_local_hit_tokens"], kv["num_prefix_queried_tokens"])
    assert hits == (3072, 128, 4096)
    assert (kv["num_blocks_loaded"], kv["num_blocks_saved"], kv["num_failed_load_tokens"]) == (96, 100, 16)
    assert (kv["num_bytes_loaded"], kv["num_bytes_saved"]) == (70_000_000, 200_000_000)
    assert kv["load_gbps"] == pytest.approx(70e6 / 0.014 / 1e9) and kv["save_gbps"] == pytest.approx(4.0)


def test_no_connector_no_section_unless_external_hits():
    assert kv_deltas(SCHEDULER, SCHEDULER | {"num_prefix_cache_hit_tokens": 500}) is None
    assert kv_deltas({}, {"num_running": 0}) is None  # an older engine: no such keys at all
    # Hits from a connector the stats do not name: a section, every missing counter 0, rates unknown.
    kv = kv_deltas({}, {"num_external_prefix_hit_tokens": 64})
    assert kv["connector"] is None and kv["num_external_hit_tokens"] == 64 and kv["num_bytes_loaded"] == 0
    assert kv["load_gbps"] is None and kv["save_gbps"] is None


def test_connector_that_moved_nothing_has_no_rates_and_no_memcpy():
    kv = kv_section(SCHEDULER | {"kv_connector": "offload"}, SCHEDULER | {"kv_connector": "offload"})
    assert kv["load_gbps"] is None and kv["memcpy_gbps"] is None and kv["num_blocks_saved"] == 0


def test_memcpy_reference_times_at_least_a_mebibyte(monkeypatch):
    sizes = []

    def fake_time_memcpy_us(nbytes, repeats):
        sizes.append(nbytes)
        return {"nbytes": nbytes, "p50_us": 100.0, "p99_us": 200.0}

    monkeypatch.setattr("asyncpp.bench.kv_report.time_memcpy_us", fake_time_memcpy_us)
    small = kv_section({"kv_connector": "offload"}, {"kv_connector": "offload", "kv_bytes_saved": 4096})
    assert sizes == [MIN_MEMCPY_BYTES] and small["memcpy_gbps"] == pytest.approx(MIN_MEMCPY_BYTES / 100e-6 / 1e9)
    kv_section(BEFORE, AFTER)
    assert sizes[-1] == 70_000_000  # the bytes loaded, under the 256 MiB cap


def test_memcpy_reference_is_a_real_rate():
    kv = kv_section({"kv_connector": "offload"}, {"kv_connector": "offload", "kv_bytes_loaded": 2 << 20})
    assert kv["memcpy_gbps"] > 0


def test_report_lines():
    kv = kv_deltas(BEFORE, AFTER) | {"memcpy_gbps": 12.34}
    first, second = kv_lines(kv)
    assert first == ("kv offload: loaded 3072 tok (96 stage-blocks, 70.0 MB at 5.0 GB/s), "
                     "saved 200.0 MB at 4.0 GB/s; memcpy 12.3 GB/s")
    big = kv | {"num_bytes_saved": 2_345_000_000}
    assert "saved 2.35 GB at" in kv_lines(big)[0]
    assert second == "  prefix hits: external 3072 tok, local 128 tok of 4096 queried; failed loads 16 tok"
    unnamed = kv_lines(kv_deltas({}, {"num_external_prefix_hit_tokens": 64}) | {"memcpy_gbps": None})
    assert unnamed[0] == "kv ?: loaded 64 tok (0 stage-blocks, 0.0 MB at -), saved 0.0 MB at -; memcpy -"


def fake_run(label: str, kv: dict | None, ttft_split: bool) -> dict:
    records = [RequestRecord(num_output_tokens=2, ttft_s=t, e2e_s=t + 0.1, itl_s=[0.1], burst=b)
               for t, b in ((0.4, 0), (0.1, 1))]
    metrics = serving_metrics(records, duration_s=1.0)
    if ttft_split:
        metrics |= {"ttft_cold_ms": {"p50": 400.0, "p99": 400.0, "count": 1},
                    "ttft_warm_ms": {"p50": 100.0, "p99": 100.0, "count": 1}}
    cpu = {"core_pct": 50.0, "cpu_us_per_output_token": 10.0}
    return {
        "label": label, "num_cores": 1, "metrics": metrics, "kv_transfer": kv,
        "stages": {"busy_fraction": [0.5], "num_steps": 4, "handoff_us_p50": [], "handoff_us_p99": []},
        "cpu": {"engine": cpu, "client": cpu, "stages": [cpu], "machine_busy": cpu, "machine_stolen": cpu},
        "memcpy": {k: {"num_tokens": 1, "nbytes": 2048, "p50_us": 1.0, "p99_us": 2.0} for k in ("decode", "prefill")},
    }


def test_run_block_and_summary_show_kv_and_cold_warm_ttft_only_when_present():
    kv = kv_deltas(BEFORE, AFTER) | {"memcpy_gbps": 12.34}
    block = report.run_block(fake_run("offload", kv, ttft_split=True))
    assert "KV connector (measured window)" in block and "kv offload: loaded 3072 tok" in block
    assert "P50 / P99 TTFT cold, 1 req (ms):" in block and "100.0 / 100.0" in block
    plain = report.run_block(fake_run("none", None, ttft_split=False))
    assert "kv " not in plain and "TTFT cold" not in plain
    runs = [fake_run("none", None, True), fake_run("offload", kv, True)]
    table = report.summary_table({"runs": runs})
    assert "TTFT warm prefix p50/p99 ms" in table and "KV load/save GB/s (memcpy)" in table
    assert "5.0 / 4.0 (12.3)" in table and "3072 / 128" in table
    assert "KV" not in report.summary_table({"runs": [fake_run("none", None, False)]})
    rows = ratio_rows("none", runs[0]["metrics"], "offload", runs[1]["metrics"])
    warm = [r for r in rows if r["metric"] == "ttft_warm_ms.p50"]
    assert len(warm) == 1 and warm[0]["ratio"] == pytest.approx(1.0)
    assert "TTFT p50 warm prefix = 1.00x offload" in report.ratio_lines({"baseline": "none", "ratios": rows})
