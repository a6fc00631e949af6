"""The shared-prefix workload: prompts that open with one of a few long prefixes.

Request i opens with the prefix of group `prefix_group(i, ...)`, i.e.
`(i // burst_size) % num_groups` (a burst of one when bursts are off), so
every request of a burst shares one prefix and consecutive bursts can take
different ones: with an engine cache smaller than all the prefixes together,
each prefix is evicted before its group comes back, where a KV connector can
load it instead of a recompute. After the prefix comes a suffix of its own:
the random workload's prompt (`random_requests`, same seed, same lengths),
whose output length the request keeps.

Cold and warm TTFT: a request is cold when it belongs to the first burst that
used its prefix and warm when an earlier burst had it. Without bursts every
request is its own "burst" in send order, so warm only says an earlier sent
request had the prefix; it may still have been in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncpp.bench.datasets import BenchRequest, random_requests
from asyncpp.bench.metrics import RequestRecord, percentile
from asyncpp.bench.prompts import synthetic_prompts

# The prefixes' words come from their own seed, apart from the suffixes' and the warm-up's (seed + 1000).
PREFIX_SEED_OFFSET = 7919


def prefix_group(index: int, num_groups: int, burst_size: int | None) -> int:
    return (index // (burst_size or 1)) % num_groups


def shared_prefix_requests(
    num_prompts: int,
    prefix_len: int,
    num_groups: int,
    suffix_len: int,
    output_len: int,
    *,
    burst_size: int | None = None,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` requests: the group's `prefix_len` words, then `suffix_len` random words of their own."""
    if prefix_len < 1 or num_groups < 1:
        raise ValueError(f"shared prefix length and groups must be >= 1, got {prefix_len} and {num_groups}")
    prefixes = synthetic_prompts(num_groups, prefix_len, prefix_len, seed + PREFIX_SEED_OFFSET)
    suffixes = random_requests(num_prompts, suffix_len, output_len, range_ratio, seed)
    return [
        BenchRequest(f"{prefixes[prefix_group(i, num_groups, burst_size)]} {s.prompt}", s.output_len)
        for i, s in enumerate(suffixes)
    ]


def cold_warm_ttft(records: Sequence[RequestRecord], groups: Sequence[int]) -> dict[str, dict[str, Any]]:
    """{"ttft_cold_ms": ..., "ttft_warm_ms": ...}, each {"p50", "p99", "count"} over successful requests.

    `records` in send order, `groups[i]` the prefix group of request i.
    """
    first_burst: dict[int, int] = {}  # group -> the first burst (send order) that used it
    ttfts_ms: dict[str, list[float]] = {"ttft_cold_ms": [], "ttft_warm_ms": []}
    for i, (record, group) in enumerate(zip(records, groups, strict=True)):
        burst = i if record.burst is None else record.burst
        is_cold = first_burst.setdefault(group, burst) == burst
        if record.is_ok and record.ttft_s is not None:
            ttfts_ms["ttft_cold_ms" if is_cold else "ttft_warm_ms"].append(record.ttft_s * 1e3)
    return {
        key: {"p50": percentile(values, 50), "p99": percentile(values, 99), "count": len(values)}
        for key, values in ttfts_ms.items()
    }
