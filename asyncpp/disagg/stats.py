"""The router's counters and the stats reply that merges both engines' stats.

The reply keeps the decode engine's stats at the top level, so whatever
reads one engine's stats (the HTTP front end's /metrics gauges: running,
waiting, KV usage) reads the decode engine's, where the requests spend their
lives; both engines' full stats sit under "prefill" and "decode" (None when
that engine does not answer), and the router's own under `pd_*`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncpp.samples import RecentSamples

@dataclass
class RouterCounters:
    num_requests: int = 0  # accepted by the router
    num_handovers: int = 0  # handed from the prefill engine to the decode engine
    num_finished: int = 0
    num_aborted: int = 0
    num_failed: int = 0
    num_released_after_prefill: int = 0  # after_prefill: aborted with the prefill's params, released at once
    num_prefills_timed: int = 0
    prefill_s_sum: float = 0.0
    second_token_s: RecentSamples = field(default_factory=RecentSamples)

    def prefill_done(self, prefill_s: float) -> None:
        """Prefill request sent -> its final delta in."""
        self.num_prefills_timed += 1
        self.prefill_s_sum += prefill_s

    def second_token_done(self, seconds: float) -> None:
        """The prefill engine's token in -> the decode engine's first delta in: the client's gap
        between its first two tokens (the handover, then one decode step)."""
        self.second_token_s.add(seconds)

    def stats(self) -> dict[str, Any]:
        return {
            "pd_num_requests": self.num_requests,
            "pd_num_handovers": self.num_handovers,
            "pd_num_finished": self.num_finished,
            "pd_num_aborted": self.num_aborted,
            "pd_num_failed": self.num_failed,
            "pd_num_released_after_prefill": self.num_released_after_prefill,
            "pd_prefill_s_mean": _mean(self.prefill_s_sum, self.num_prefills_timed),
            **self.second_token_s.summary("pd_second_token_s"),
        }


def merged_stats(
    prefill: dict[str, Any] | None, decode: dict[str, Any] | None, router: dict[str, Any]
) -> dict[str, Any]:
    return {**(decode or {}), "prefill": prefill, "decode": decode, **router}


def _mean(total: float, count: int) -> float | None:
    return total / count if count else None
