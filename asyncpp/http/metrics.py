"""Prometheus metrics with vLLM's names where they mean the same.

Engine-wide gauges (running and waiting requests, KV-cache usage),
speculative decoding's counters (`vllm:spec_decode_*`, totals since the
engine started, every client's requests) and, with a KV connector, its
transfer counters and handover times (`asyncpp:kv_*`; behind a
prefill/decode router, the decode engine's and the router's `asyncpp:pd_*`)
are read from the engine's stats when `/metrics` is scraped; the other counters and histograms are kept here,
per request served over HTTP (requests of native clients are not in them).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class HttpMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests being computed.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter(
            "vllm:request_success", "Requests finished, by finish reason.", labels + ["finished_reason"], registry=r
        )
        self.failed = Counter("asyncpp:request_failure", "Requests that ended in an error (an abort by a client that left is not one).", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds", "Mean time per output token of a request, after the first.",
            labels, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.model_name = model_name
        self.spec_decode = _SpecDecodeCounters(model_name)
        r.register(self.spec_decode)
        self.kv_transfer = _KVTransferMetrics(model_name)
        r.register(self.kv_transfer)
        self.recovery = _RecoveryMetrics(model_name)
        r.register(self.recovery)

    def request_done(self, record: RequestTimes, finish_reason: str | None, has_failed: bool = False) -> None:
        """A request's end: finished (by its reason), failed (an error reached its client), or aborted
        (its client left first: `vllm:request_success{finished_reason="abort"}`, as vLLM counts it)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(record.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(record.num_output_tokens)
        if finish_reason is None:
            if has_failed:
                self.failed.labels(m).inc()
            else:
                self.success.labels(m, "abort").inc()
            return
        self.success.labels(m, finish_reason).inc()
        if record.first_token_at is not None:
            self.ttft.labels(m).observe(record.first_token_at - record.started_at)
            if record.num_output_tokens > 1:
                self.tpot.labels(m).observe((record.last_token_at - record.first_token_at) / (record.num_output_tokens - 1))
        self.e2e.labels(m).observe(record.last_token_at - record.started_at)

    def render(self, stats: dict[str, Any] | None) -> bytes:
        m = self.model_name
        if stats is not None:
            self.running.labels(m).set(stats.get("num_running", 0))
            self.waiting.labels(m).set(stats.get("num_waiting", 0))
            total = stats.get("num_kv_blocks") or 0
            used = total - stats.get("num_free_kv_blocks", total)
            self.kv_usage.labels(m).set(used / total if total else 0.0)
            self.spec_decode.stats = stats
            self.kv_transfer.stats = stats
            self.recovery.stats = stats
        return generate_latest(self.registry)


class _SpecDecodeCounters:
    """vLLM's speculative decoding counters, from the engine's totals (absent while it is off)."""

    _TOTALS = (
        ("num_drafts", "Requests' steps that verified drafts."),
        ("num_draft_tokens", "Draft tokens verified."),
        ("num_accepted_tokens", "Draft tokens accepted."),
    )

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self):
        per_pos = self.stats.get("spec_decode_num_accepted_tokens_per_pos")
        if not per_pos:  # speculative decoding is off
            return
        for name, doc in self._TOTALS:
            family = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], self.stats.get(f"spec_decode_{name}", 0))
            yield family
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            labels=["model_name", "position"],
        )  # fmt: skip
        for position, count in enumerate(per_pos):
            family.add_metric([self.model_name, str(position)], count)
        yield family


class _KVTransferMetrics:
    """The KV connector's totals and handover times from the engine's stats (absent without one)."""

    _COUNTERS = (  # (stats key, metric, help)
        ("kv_blocks_loaded", "asyncpp:kv_blocks_loaded", "KV blocks loaded by the connector, summed over stages."),
        ("kv_bytes_loaded", "asyncpp:kv_bytes_loaded", "KV bytes loaded by the connector, summed over stages."),
        ("kv_blocks_saved", "asyncpp:kv_blocks_saved", "KV blocks saved by the connector, summed over stages."),
        ("kv_bytes_saved", "asyncpp:kv_bytes_saved", "KV bytes saved by the connector, summed over stages."),
        ("num_failed_load_tokens", "asyncpp:kv_failed_load_tokens", "Tokens whose KV failed to load (recomputed)."),
        ("num_timed_out_transfers", "asyncpp:kv_timed_out_transfers", "KV transfers aborted at their deadline."),
        ("kv_num_handovers", "asyncpp:kv_handovers", "Requests whose remote KV arrived (prefill/decode)."),
        ("pd_num_handovers", "asyncpp:pd_handovers", "Requests the router handed to the decode engine."),
        ("pd_num_failed", "asyncpp:pd_failed", "Requests the router failed."),
    )
    _GAUGES = (  # (stats key, metric, help)
        (
            "kv_num_quarantined_blocks", "asyncpp:kv_quarantined_blocks",
            "KV blocks kept out of the free pool: a read into them could not be stopped yet.",
        ),
    )  # fmt: skip
    _QUANTILES = (  # (stats key prefix, metric, help): gauges by quantile over recent requests
        ("kv_handover_s", "asyncpp:kv_handover_seconds", "Remote prefill's first token -> KV on every decode stage."),
        ("pd_second_token_s", "asyncpp:pd_second_token_seconds", "Prefill engine's token -> decode engine's first."),
    )

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self):
        if not self.stats.get("kv_connector") and "pd_num_handovers" not in self.stats:
            return
        for key, name, doc in self._COUNTERS:
            if self.stats.get(key) is not None:
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], self.stats[key])
                yield family
        for key, name, doc in self._GAUGES:
            if self.stats.get(key) is not None:
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], self.stats[key])
                yield family
        for prefix, name, doc in self._QUANTILES:
            values = {q: self.stats.get(f"{prefix}_{suffix}") for q, suffix in (("0.5", "p50"), ("0.99", "p99"))}
            if any(v is not None for v in values.values()):
                family = GaugeMetricFamily(name, doc, labels=["model_name", "quantile"])
                for quantile, value in values.items():
                    if value is not None:
                        family.add_metric([self.model_name, quantile], value)
                yield family


class _RecoveryMetrics:
    """Stage restarts (`asyncpp.runtime.recovery`): how many, and how long each took to serve again."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self):
        if "stage_restarts" not in self.stats:
            return
        family = CounterMetricFamily(
            "asyncpp:stage_restarts", "Stage restarts (a lost stage replaced in place), failed ones included.",
            labels=["model_name"],
        )  # fmt: skip
        family.add_metric([self.model_name], self.stats["stage_restarts"])
        yield family
        times = self.stats.get("stage_recovery_s") or []
        buckets = [(str(b), sum(t <= b for t in times)) for b in _RECOVERY_BUCKETS] + [("+Inf", len(times))]
        family = HistogramMetricFamily(
            "asyncpp:stage_recovery_seconds", "A stage lost -> the new stages serving again (recent recoveries).",
            labels=["model_name"],
        )  # fmt: skip
        family.add_metric([self.model_name], buckets, sum(times))
        yield family


class RequestTimes:
    """One request's clock: started, first and last token, token counts."""

    def __init__(self, started_at: float, metrics: HttpMetrics) -> None:
        self.started_at = started_at
        self.first_token_at: float | None = None
        self.last_token_at = started_at
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.metrics = metrics

    def on_tokens(self, now: float, num_tokens: int, num_prompt_tokens: int) -> None:
        if num_prompt_tokens:
            self.num_prompt_tokens = num_prompt_tokens
        if not num_tokens:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            gap = (now - self.last_token_at) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.labels(self.metrics.model_name).observe(gap)
        self.last_token_at = now
        self.num_output_tokens += num_tokens
