"""/metrics: a KV connector's transfer totals and handover times, read from the engine's stats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from asyncpp.http.metrics import HttpMetrics


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_kv_transfer_counters_and_handover_quantiles_only_with_a_connector():
    stats = {
        "kv_connector": "pd", "kv_blocks_loaded": 64, "kv_bytes_loaded": 23_592_960, "kv_blocks_saved": 0,
        "kv_bytes_saved": 0, "num_timed_out_transfers": 1, "kv_num_handovers": 2,
        "kv_handover_s_p50": 0.0105, "kv_handover_s_p99": 0.03, "pd_num_handovers": 2, "pd_num_failed": 0,
        "pd_second_token_s_p50": 0.018, "pd_second_token_s_p99": None, "kv_num_quarantined_blocks": 3,
    }  # fmt: skip
    samples = {name: value for (name, _), value in _samples(HttpMetrics("m").render(stats)).items()}
    assert samples["asyncpp:kv_blocks_loaded_total"] == 64
    assert samples["asyncpp:kv_bytes_loaded_total"] == 23_592_960
    assert samples["asyncpp:kv_timed_out_transfers_total"] == 1
    assert samples["asyncpp:kv_handovers_total"] == samples["asyncpp:pd_handovers_total"] == 2
    assert samples["asyncpp:kv_quarantined_blocks"] == 3  # a gauge: blocks out of the free pool now
    text = HttpMetrics("m").render(stats).decode()
    assert 'asyncpp:kv_handover_seconds{model_name="m",quantile="0.5"} 0.0105' in text
    assert 'asyncpp:kv_handover_seconds{model_name="m",quantile="0.99"} 0.03' in text
    assert 'asyncpp:pd_second_token_seconds{model_name="m",quantile="0.5"} 0.018' in text
    assert 'pd_second_token_seconds{model_name="m",quantile="0.99"}' not in text  # no value yet
    plain = HttpMetrics("m").render({"num_running": 1}).decode()
    assert "asyncpp:kv_" not in plain and "asyncpp:pd_" not in plain
