"""The KV connector's figures over a run's measured window, next to a memcpy of the same bytes.

From the engine's stats before and after the window: prompt tokens served
from the engine's own prefix cache and from the connector (loaded instead of
computed), blocks, bytes and thread time per direction (summed over stages),
and the rates those give in GB/s. The memcpy reference is one contiguous
`copy_` of the bytes moved (up to 256 MiB), timed in this process: the
floor for moving the same bytes within one address space.
"""

from __future__ import annotations

from typing import Any

from asyncpp.bench.memcpy import time_memcpy_us

_COUNTERS = (
    "num_prefix_cache_hit_tokens",
    "num_external_prefix_hit_tokens",
    "num_failed_load_tokens",
    "kv_blocks_loaded",
    "kv_blocks_saved",
    "kv_bytes_loaded",
    "kv_bytes_saved",
    "kv_load_time_s",
    "kv_save_time_s",
)
MAX_MEMCPY_BYTES = 256 * 1024 * 1024


def kv_section(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Deltas over the window and GB/s per direction; None without a connector."""
    if "kv_connector" not in after:
        return None
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in _COUNTERS}
    out: dict[str, Any] = {"connector": after["kv_connector"], **delta}
    for direction, done in (("load", "loaded"), ("save", "saved")):
        nbytes, seconds = delta[f"kv_bytes_{done}"], delta[f"kv_{direction}_time_s"]
        out[f"{direction}_gbps"] = nbytes / seconds / 1e9 if seconds > 0 else None
    nbytes = delta["kv_bytes_loaded"] or delta["kv_bytes_saved"]
    if nbytes:
        size = max(1 << 20, min(nbytes, MAX_MEMCPY_BYTES))
        timing = time_memcpy_us(size, repeats=20)
        out["memcpy_gbps"] = size / (timing["p50_us"] * 1e-6) / 1e9
    else:
        out["memcpy_gbps"] = None
    return out


def kv_lines(kv: dict[str, Any]) -> list[str]:
    def gbps(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} GB/s"

    return [
        f"KV {kv['connector']}: prefix tokens from the connector {kv['num_external_prefix_hit_tokens']}, "
        f"from the engine cache {kv['num_prefix_cache_hit_tokens']}, failed loads {kv['num_failed_load_tokens']}",
        f"  loaded {kv['kv_blocks_loaded']} blocks {kv['kv_bytes_loaded'] / 1e6:.1f} MB at {gbps(kv['load_gbps'])}, "
        f"saved {kv['kv_blocks_saved']} blocks {kv['kv_bytes_saved'] / 1e6:.1f} MB at {gbps(kv['save_gbps'])} "
        f"(summed over stages); memcpy {gbps(kv['memcpy_gbps'])}",
    ]
