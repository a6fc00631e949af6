"""The KV connector's figures over a run's measured window, next to a memcpy of the same size.

From the engine's stats before and after the window (cumulative counters,
each missing one read as 0, so older engines and runs without a connector
work): prompt tokens served from the engine's own prefix cache ("local") and
loaded by the connector instead of computed ("external"), and per direction
the blocks, bytes and transfer-thread seconds. Blocks, bytes and seconds are
summed over pipeline stages (each stage moves its own layers of every block),
so bytes / seconds is the mean rate of one stage's transfer thread. The
memcpy reference is one contiguous single-thread `copy_` of min(bytes moved,
256 MiB) bytes (at least 1 MiB), timed in this process: the floor for moving
those bytes within one address space.
"""

from __future__ import annotations

from typing import Any

from asyncpp.bench.memcpy import time_memcpy_us

# Window delta key -> engine stats counter.
COUNTERS = {
    "num_prefix_queried_tokens": "num_prefix_cache_queries_tokens",
    "num_local_hit_tokens": "num_prefix_cache_hit_tokens",
    "num_external_hit_tokens": "num_external_prefix_hit_tokens",
    "num_failed_load_tokens": "num_failed_load_tokens",
    "num_blocks_loaded": "kv_blocks_loaded",
    "num_blocks_saved": "kv_blocks_saved",
    "num_bytes_loaded": "kv_bytes_loaded",
    "num_bytes_saved": "kv_bytes_saved",
    "load_time_s": "kv_load_time_s",
    "save_time_s": "kv_save_time_s",
}
MIN_MEMCPY_BYTES = 1 << 20
MAX_MEMCPY_BYTES = 256 << 20
MEMCPY_REPEATS = 20  # up to 256 MiB each: a second or so, once per run


def kv_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Counter deltas and GB/s per direction; None without a connector and without external hits."""
    delta = {key: (after.get(stat) or 0) - (before.get(stat) or 0) for key, stat in COUNTERS.items()}
    if "kv_connector" not in after and not delta["num_external_hit_tokens"]:
        return None
    out: dict[str, Any] = {"connector": after.get("kv_connector"), **delta}
    for direction, done in (("load", "loaded"), ("save", "saved")):
        seconds = delta[f"{direction}_time_s"]
        out[f"{direction}_gbps"] = delta[f"num_bytes_{done}"] / seconds / 1e9 if seconds > 0 else None
    return out


def memcpy_gbps(nbytes: int) -> float:
    """GB/s of one `copy_` of min(nbytes, 256 MiB) bytes, at least 1 MiB (median of a few)."""
    size = max(MIN_MEMCPY_BYTES, min(nbytes, MAX_MEMCPY_BYTES))
    return size / (time_memcpy_us(size, repeats=MEMCPY_REPEATS)["p50_us"] * 1e-6) / 1e9


def kv_section(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """`kv_deltas` plus `memcpy_gbps` (None when no byte moved)."""
    kv = kv_deltas(before, after)
    if kv is not None:
        nbytes = kv["num_bytes_loaded"] or kv["num_bytes_saved"]
        kv["memcpy_gbps"] = memcpy_gbps(nbytes) if nbytes else None
    return kv


def kv_lines(kv: dict[str, Any]) -> list[str]:
    """Two lines for a run's block: the transfers, then where the prompt's prefix came from."""

    def gbps(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} GB/s"

    return [
        f"kv {kv['connector'] or '?'}: loaded {kv['num_external_hit_tokens']} tok ({kv['num_blocks_loaded']} "
        f"stage-blocks, {_size(kv['num_bytes_loaded'])} at {gbps(kv['load_gbps'])}), "
        f"saved {_size(kv['num_bytes_saved'])} at {gbps(kv['save_gbps'])}; memcpy {gbps(kv['memcpy_gbps'])}",
        f"  prefix hits: external {kv['num_external_hit_tokens']} tok, local {kv['num_local_hit_tokens']} tok "
        f"of {kv['num_prefix_queried_tokens']} queried; failed loads {kv['num_failed_load_tokens']} tok",
    ]


def kv_rates(kv: dict[str, Any] | None) -> str:
    """Summary table cell: load / save GB/s (memcpy GB/s)."""
    if not kv:
        return "-"
    return " / ".join(_fmt(kv[k]) for k in ("load_gbps", "save_gbps")) + f" ({_fmt(kv['memcpy_gbps'])})"


def kv_hits(kv: dict[str, Any] | None) -> str:
    """Summary table cell: external / local prefix-hit tokens."""
    return "-" if not kv else f"{kv['num_external_hit_tokens']} / {kv['num_local_hit_tokens']}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
