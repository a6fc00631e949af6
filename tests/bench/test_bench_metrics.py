"""Metric math of the serving benchmark on synthetic timings."""

from __future__ import annotations

import math

import pytest

from asyncpp.bench.load import arrival_gaps_s
from asyncpp.bench.memcpy import handoff_nbytes
from asyncpp.bench.metrics import (
    RATIO_METRICS,
    RequestRecord,
    TokenTimer,
    busy_fractions,
    percentile,
    ratio_rows,
    serving_metrics,
    summarize_ratios,
)


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 99) == pytest.approx(4.96)  # numpy.percentile(values, 99)
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def record_from(sent_at: float, token_times: list[float], tokens_per_delta: list[int] | None = None) -> RequestRecord:
    record = RequestRecord(expected_output_len=sum(tokens_per_delta or [1] * len(token_times)), sent_at=sent_at)
    timer = TokenTimer(record)
    timer.on_delta(sent_at + 0.001, 0, 10)  # a delta without tokens changes no timing
    for t, n in zip(token_times, tokens_per_delta or [1] * len(token_times)):
        timer.on_delta(t, n, 10)
    timer.on_finish(token_times[-1])
    return record


def test_ttft_itl_tpot_definitions():
    r = record_from(10.0, [10.5, 10.6, 10.8, 11.1])
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert r.num_output_tokens == 4 and r.num_chunks == 4 and r.prompt_len == 10


def test_multi_token_delta_is_one_itl_gap_and_single_token_has_no_tpot():
    r = record_from(0.0, [1.0, 2.0], tokens_per_delta=[1, 3])
    assert r.num_output_tokens == 4 and r.itl_s == [1.0]
    assert r.tpot_s == pytest.approx(1.0 / 3)
    assert record_from(0.0, [0.2]).tpot_s is None


def test_serving_metrics_aggregate_over_successful_requests():
    a = record_from(0.0, [1.0, 2.0, 3.0])  # ttft 1, itl 1,1, tpot 1
    b = record_from(0.0, [2.0, 5.0, 8.0])  # ttft 2, itl 3,3, tpot 3
    failed = RequestRecord(expected_output_len=3, error="boom")
    m = serving_metrics([a, b, failed], duration_s=8.0)
    assert (m["completed"], m["failed"], m["num_requests"]) == (2, 1, 3)
    assert m["total_output_tokens"] == 6 and m["total_input_tokens"] == 20
    assert m["request_throughput"] == pytest.approx(0.25)
    assert m["output_throughput"] == pytest.approx(0.75)
    assert m["mean_ttft_ms"] == pytest.approx(1500.0)
    assert m["mean_tpot_ms"] == pytest.approx(2000.0)
    assert m["mean_itl_ms"] == pytest.approx(2000.0) and m["p50_itl_ms"] == pytest.approx(2000.0)
    assert m["p99_itl_ms"] == pytest.approx(3000.0)
    assert m["num_itl_samples"] == 4
    assert m["p99_e2el_ms"] == pytest.approx(3000.0 + 0.99 * 5000.0)


def test_busy_fractions_are_deltas_over_the_window():
    before = {"uptime_s": 10.0, "stage_busy_s": [1.0, 2.0]}
    after = {"uptime_s": 20.0, "stage_busy_s": [9.0, 4.5]}
    assert busy_fractions(before, after) == pytest.approx([0.8, 0.25])


def test_ratio_rows_divide_subject_by_reference():
    rows = ratio_rows("a", {"output_throughput": 30.0, "mean_ttft_ms": 5.0}, "b", {"output_throughput": 20.0, "mean_ttft_ms": 0})
    by_key = {r["metric"]: r for r in rows}
    assert len(rows) == len(RATIO_METRICS)
    assert by_key["output_throughput"]["ratio"] == pytest.approx(1.5)
    assert by_key["mean_ttft_ms"]["ratio"] is None  # no division by zero
    assert by_key["request_throughput"]["ratio"] is None  # missing on both sides


def test_ttft_p50_is_compared_and_warm_prefix_ttft_only_where_both_runs_have_it():
    assert "p50_ttft_ms" in [key for key, _, _ in RATIO_METRICS]
    warm = {"ttft_warm_ms": {"p50": 30.0, "p99": 90.0, "count": 8}}
    one_sided = ratio_rows("a", warm, "b", {"p50_ttft_ms": 1.0})
    assert [r["metric"] for r in one_sided] == [key for key, _, _ in RATIO_METRICS]
    rows = ratio_rows("a", warm, "b", {"ttft_warm_ms": {"p50": 60.0, "p99": 90.0, "count": 8}})
    assert len(rows) == len(RATIO_METRICS) + 1
    assert rows[-1]["metric"] == "ttft_warm_ms.p50" and rows[-1]["ratio"] == pytest.approx(0.5)
    assert not rows[-1]["higher_is_better"]


def test_summarize_ratios_groups_repetitions_by_variant_and_metric():
    def row(repeat, metric, value):
        return {"subject": f"a #{repeat}", "reference": f"b #{repeat}", "subject_variant": "a", "reference_variant": "b",
                "metric": metric, "name": metric, "higher_is_better": True, "ratio": value, "repeat": repeat}

    rows = [row(1, "x", 1.8), row(1, "y", None), row(2, "x", 1.5), row(2, "y", 2.0), row(3, "x", 1.6), row(3, "y", None)]
    by_metric = {s["metric"]: s for s in summarize_ratios(rows)}
    assert by_metric["x"]["ratios"] == [1.8, 1.5, 1.6]
    assert (by_metric["x"]["median"], by_metric["x"]["min"], by_metric["x"]["max"]) == (1.6, 1.5, 1.8)
    assert (by_metric["x"]["subject"], by_metric["x"]["reference"]) == ("a", "b")
    assert by_metric["y"]["median"] == by_metric["y"]["min"] == by_metric["y"]["max"] == 2.0  # None left out
    assert summarize_ratios([row(1, "z", None)])[0]["median"] is None


def test_poisson_arrivals_and_all_at_once():
    assert arrival_gaps_s(5, math.inf, 0) == [0.0] * 5
    gaps = arrival_gaps_s(4000, 10.0, seed=1)
    assert gaps[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert gaps == arrival_gaps_s(4000, 10.0, seed=1)


def test_handoff_bytes():
    assert handoff_nbytes(576, 16, "bfloat16") == 576 * 16 * 2 * 2
    assert handoff_nbytes(64, 3, "float32") == 64 * 3 * 2 * 4
