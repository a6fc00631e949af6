"""A stage killed mid-run (`--runs "kill=1@20"`): what a restart in place costs the requests.

    python -m asyncpp.bench --config configs/default.toml --workload random --num-prompts 128 \\
        --max-concurrency 16 --random-input-len 64 --random-output-len 128 --runs "pp=2;pp=2,kill=1@15"

`kill=RANK@SECONDS` SIGKILLs stage RANK that many seconds after the measured
requests start (`asyncpp.runtime.recovery` restarts the stages). The run's
`recovery` section gives the time from the kill to the next token any client
received, the stage start-up times (the first start, then the restart:
processes spawned to handshakes done), the requests and tokens computed again,
and the requests that failed (none, if the restart kept its promise); its
throughput is read against the undisturbed run's in the same invocation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from asyncpp.bench.metrics import RequestRecord


@dataclass(frozen=True)
class StageKill:
    pp_rank: int
    after_s: float

    @staticmethod
    def parse(text: str) -> StageKill:
        """`"1@20"`: stage 1, 20 s after the requests start."""
        rank, sep, after = str(text).partition("@")
        try:
            kill = StageKill(int(rank), float(after))
        except ValueError:
            kill = None
        if not sep or kill is None or kill.pp_rank < 0 or kill.after_s < 0:
            raise ValueError(f"kill must be RANK@SECONDS (e.g. 1@20), got {text!r}")
        return kill


async def kill_stage(kill: StageKill, stats: Callable[[], Awaitable[dict[str, Any]]]) -> float:
    """Sleep `kill.after_s`, then SIGKILL that stage; the monotonic time of the kill."""
    await asyncio.sleep(kill.after_s)
    pids = (await stats())["stage_pids"]
    os.kill(pids[kill.pp_rank], signal.SIGKILL)
    return time.monotonic()


def token_times(record: RequestRecord) -> list[float]:
    """When each token-carrying delta of a request arrived (monotonic s)."""
    if record.ttft_s is None:
        return []
    times = [record.sent_at + record.ttft_s]
    for gap in record.itl_s:
        times.append(times[-1] + gap)
    return times


def recovery_section(
    records: Sequence[RequestRecord], killed_at: float, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    """The kill's cost, from the clients' token times and the engine's stats around the run."""
    later = [t for r in records for t in token_times(r) if t > killed_at]
    starts = after.get("stage_start_s") or []
    return {
        "kill_to_next_token_s": (min(later) - killed_at) if later else None,
        "stage_start_s": starts,  # [first start, restarts...]: processes spawned -> handshakes done
        "stage_recovery_s": after.get("stage_recovery_s", []),
        "num_restarts": after.get("stage_restarts", 0) - before.get("stage_restarts", 0),
        "num_recomputed_requests": after.get("num_recomputed_requests", 0) - before.get("num_recomputed_requests", 0),
        "num_recomputed_tokens": after.get("num_recomputed_tokens", 0) - before.get("num_recomputed_tokens", 0),
        "num_failed_requests": sum(not r.is_ok for r in records),
    }
