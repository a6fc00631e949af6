"""The data-parallel router's counters, and the stats reply that merges its replicas' stats.

What reads one engine's stats (the HTTP front end's /metrics: running,
waiting, KV blocks, the connector's and drafts' totals, stage restarts) reads
the deployment's whole: counts are summed over the replicas that answer
(`num_*` keys, the KV connector's block and byte totals, `stage_restarts`,
`cpu_s`; draft acceptance per position element by element; recovery times
and `stage_pids` joined, so a benchmark measures every stage's CPU). The other
values that describe the engine (dtype, ISA, compute plan) are the first
answering replica's; what names one process (`pid`, `run_id`, `uptime_s`,
`layer_balance`) is left to each replica's
own stats, all of them under "replicas" (None where a replica does not
answer). The router's own counters are `dp_*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUMMED = frozenset({"kv_blocks_loaded", "kv_bytes_loaded", "kv_blocks_saved", "kv_bytes_saved", "stage_restarts", "cpu_s"})
JOINED = frozenset({"stage_recovery_s", "stage_pids"})
ELEMENTWISE = frozenset({"spec_decode_num_accepted_tokens_per_pos"})
PER_PROCESS = frozenset({"pid", "run_id", "uptime_s", "layer_balance", "is_dead"})


@dataclass
class RouterCounters:
    num_requests: int = 0  # accepted by the router
    num_finished: int = 0
    num_aborted: int = 0
    num_failed: int = 0

    def stats(self) -> dict[str, Any]:
        return {
            "dp_num_requests": self.num_requests,
            "dp_num_finished": self.num_finished,
            "dp_num_aborted": self.num_aborted,
            "dp_num_failed": self.num_failed,
        }


def is_summed(key: str, value: Any) -> bool:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and (key.startswith("num_") or "_num_" in key or key in SUMMED)


def merged_stats(replicas: list[dict[str, Any] | None], router: dict[str, Any]) -> dict[str, Any]:
    """The replicas' stats as one engine's (module docstring), each replica's under "replicas", the router's on top."""
    merged: dict[str, Any] = {}
    for stats in (s for s in replicas if s is not None):
        for key, value in stats.items():
            if key in PER_PROCESS:
                continue
            if key not in merged:
                merged[key] = list(value) if isinstance(value, list) else value
            elif key in JOINED and isinstance(value, list):
                merged[key] = merged[key] + value
            elif key in ELEMENTWISE and isinstance(value, list):
                merged[key] = _add_elementwise(merged[key], value)
            elif is_summed(key, value) and is_summed(key, merged[key]):
                merged[key] += value
    return {**merged, "replicas": replicas, **router}


def _add_elementwise(a: list[Any], b: list[Any]) -> list[Any]:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]
