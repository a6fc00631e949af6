"""How `/metrics` counts a request's end: finished (by its reason), failed (an error reached its client), or
aborted (its client left first: `vllm:request_success{finished_reason="abort"}`, as vLLM counts it, not a
failure)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncpp.http.metrics import HttpMetrics, RequestTimes


def _samples(metrics: HttpMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_finished_failed_and_aborted_requests_are_told_apart():
    metrics = HttpMetrics("m")
    for finish_reason, has_failed in (("stop", False), ("length", False), (None, True), (None, False), (None, False)):
        times = RequestTimes(0.0, metrics)
        times.on_tokens(0.5, 1, 3)
        metrics.request_done(times, finish_reason, has_failed)
    samples = _samples(metrics)
    success = {dict(labels)["finished_reason"]: v for (name, labels), v in samples.items() if name == "vllm:request_success_total"}
    assert success == {"stop": 1.0, "length": 1.0, "abort": 2.0}
    assert samples[("asyncpp:request_failure_total", ())] == 1.0
    assert samples[("vllm:e2e_request_latency_seconds_count", ())] == 2.0  # finished requests only
    assert samples[("vllm:prompt_tokens_total", ())] == 15.0  # every request's prompt was processed
