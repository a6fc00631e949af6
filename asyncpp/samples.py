"""`RecentSamples`: the last N values of a duration, summed up as mean, p50 and p99 for `stats()`;
`LatestPerKey`: the same with one value per key (a request reported by several stages)."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

MAX_SAMPLES = 10_000


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (None without values)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class RecentSamples:
    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self.count = 0  # every sample ever added
        self._recent: collections.deque[float] = collections.deque(maxlen=max_samples)

    def add(self, value: float) -> None:
        self.count += 1
        self._recent.append(value)

    def summary(self, prefix: str) -> dict[str, Any]:
        """`{prefix}_mean`, `_p50`, `_p99` over the recent samples (None without any)."""
        mean = sum(self._recent) / len(self._recent) if self._recent else None
        return {
            f"{prefix}_mean": mean,
            f"{prefix}_p50": percentile(self._recent, 50),
            f"{prefix}_p99": percentile(self._recent, 99),
        }


class LatestPerKey:
    """One sample per key, the largest reported: stages that report the same request's figure in
    different steps (each when its own pull ended) make one sample, the last stage's, not several."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self.count = 0  # keys ever seen
        self.max_samples = max_samples
        self._by_key: collections.OrderedDict[str, float] = collections.OrderedDict()

    def put(self, key: str, value: float) -> None:
        if key in self._by_key:
            value = max(value, self._by_key.pop(key))
        else:
            self.count += 1
            if len(self._by_key) >= self.max_samples:
                self._by_key.popitem(last=False)
        self._by_key[key] = value

    def summary(self, prefix: str) -> dict[str, Any]:
        """`{prefix}_mean`, `_p50`, `_p99` over the recent keys' samples (None without any)."""
        values = list(self._by_key.values())
        return {
            f"{prefix}_mean": sum(values) / len(values) if values else None,
            f"{prefix}_p50": percentile(values, 50),
            f"{prefix}_p99": percentile(values, 99),
        }
