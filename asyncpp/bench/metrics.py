"""Serving metrics from per-request timings; pure functions, no I/O.

Definitions (those of `vllm bench serve`):
- TTFT: from sending the request to the first delta that carries a token.
- ITL: the gap between two consecutive token-carrying deltas of one request
  (one gap per delta after the first, however many tokens a delta carries).
- TPOT: per request, (e2e latency - TTFT) / (output tokens - 1); requests
  with a single output token have none.
- Throughputs divide by the measured window: first send to last finish.
- Percentiles interpolate linearly between order statistics (numpy's default).
- Stage busy fraction: the growth of a stage's cumulative compute seconds
  over the growth of engine uptime between two `stats()` snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 99)

# (key in the metrics dict, printed name, is higher better); the ratio table compares these.
RATIO_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("request_throughput", "req/s", True),
    ("output_throughput", "output tok/s", True),
    ("mean_ttft_ms", "TTFT mean", False),
    ("p50_ttft_ms", "TTFT p50", False),
    ("p99_ttft_ms", "TTFT p99", False),
    ("mean_tpot_ms", "TPOT mean", False),
    ("p50_itl_ms", "ITL p50", False),
    ("p99_itl_ms", "ITL p99", False),
)
# Figures of the shared-prefix workload ("key.field" of a nested dict): compared where both runs have them.
OPTIONAL_RATIO_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("ttft_warm_ms.p50", "TTFT p50 warm prefix", False),
)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds on the bench's monotonic clock."""

    prompt_len: int = 0  # prompt tokens, as the engine counted them
    expected_output_len: int = 0
    num_output_tokens: int = 0
    sent_at: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one gap per token-carrying delta after the first
    num_chunks: int = 0  # token-carrying deltas
    error: str | None = None
    burst: int | None = None  # 0-based burst the request was sent in; None when bursts are off

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.is_ok or self.num_output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TokenTimer:
    """Feeds a `RequestRecord` from deltas as they arrive."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self._last_token_at: float | None = None

    def on_delta(self, now: float, num_tokens: int, num_prompt_tokens: int) -> None:
        r = self.record
        r.prompt_len = num_prompt_tokens or r.prompt_len
        if num_tokens == 0:
            return
        if self._last_token_at is None:
            r.ttft_s = now - r.sent_at
        else:
            r.itl_s.append(now - self._last_token_at)
        self._last_token_at = now
        r.num_output_tokens += num_tokens
        r.num_chunks += 1

    def on_finish(self, now: float) -> None:
        self.record.e2e_s = now - self.record.sent_at


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    values_ms = [v * 1e3 for v in values_s]
    out = {f"mean_{name}_ms": mean(values_ms)}
    for q in PERCENTILES:
        out[f"p{q}_{name}_ms"] = percentile(values_ms, q)
    return out


def serving_metrics(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.is_ok]
    num_output = sum(r.num_output_tokens for r in ok)
    num_input = sum(r.prompt_len for r in ok)
    metrics: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "num_itl_samples": sum(len(r.itl_s) for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": num_output / duration_s if duration_s > 0 else None,
        "total_token_throughput": (num_input + num_output) / duration_s if duration_s > 0 else None,
    }
    metrics |= summarize_ms("ttft", [r.ttft_s for r in ok if r.ttft_s is not None])
    metrics |= summarize_ms("tpot", [t for t in (r.tpot_s for r in ok) if t is not None])
    metrics |= summarize_ms("itl", [gap for r in ok for gap in r.itl_s])
    metrics |= summarize_ms("e2el", [r.e2e_s for r in ok])
    return metrics


def busy_fractions(before: dict[str, Any], after: dict[str, Any]) -> list[float]:
    """Per stage: compute seconds gained / uptime gained between two engine `stats()` snapshots."""
    window_s = after["uptime_s"] - before["uptime_s"]
    if window_s <= 0:
        return [0.0 for _ in after["stage_busy_s"]]
    return [(b1 - b0) / window_s for b0, b1 in zip(before["stage_busy_s"], after["stage_busy_s"])]


def ratio(subject: float | None, reference: float | None) -> float | None:
    if subject is None or reference is None or reference == 0:
        return None
    return subject / reference


def metric_value(metrics: dict, key: str) -> Any:
    """`metrics[key]`, or `metrics[outer][inner]` for "outer.inner"; None where missing."""
    outer, _, inner = key.partition(".")
    value = metrics.get(outer)
    if inner:
        return value.get(inner) if isinstance(value, dict) else None
    return value


def ratio_rows(subject: str, subject_metrics: dict, reference: str, reference_metrics: dict) -> list[dict]:
    """One row per `RATIO_METRICS` entry, then per optional one both sides have: subject value / reference value."""
    optional = [
        entry for entry in OPTIONAL_RATIO_METRICS
        if metric_value(subject_metrics, entry[0]) is not None and metric_value(reference_metrics, entry[0]) is not None
    ]
    return [
        {
            "subject": subject,
            "reference": reference,
            "metric": key,
            "name": name,
            "higher_is_better": higher,
            "ratio": ratio(metric_value(subject_metrics, key), metric_value(reference_metrics, key)),
        }
        for key, name, higher in (*RATIO_METRICS, *optional)
    ]


def summarize_ratios(rows: Sequence[dict]) -> list[dict]:
    """Ratio rows of several repetitions -> one row per (subject, reference, metric): median, min, max.

    Rows name their run's variant in `subject_variant` / `reference_variant`
    (the label without the repetition); a ratio that could not be taken (None)
    is left out of its group.
    """
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["subject_variant"], row["reference_variant"], row["metric"]), []).append(row)
    summary = []
    for (subject, reference, metric), group in groups.items():
        values = [r["ratio"] for r in group if r["ratio"] is not None]
        summary.append({
            "subject": subject,
            "reference": reference,
            "metric": metric,
            "name": group[0]["name"],
            "higher_is_better": group[0]["higher_is_better"],
            "ratios": [r["ratio"] for r in group],
            "median": percentile(values, 50),
            "min": min(values, default=None),
            "max": max(values, default=None),
        })
    return summary
