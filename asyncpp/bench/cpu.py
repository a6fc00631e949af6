"""CPU time of the benchmark's processes over the measured window; no psutil.

On a machine with as many cores as pipeline stages, every CPU-millisecond the
engine process and the benchmark client spend is taken from the stages, so
the serve benchmark reports it per output token. A process's CPU time is
user + system time of all its threads (`/proc/<pid>/stat` fields 14 and 15,
in clock ticks); children are not counted. The client reads its own with
`time.process_time()` (nanosecond resolution); the engine reports its own in
its stats reply (`cpu_s`); stages are read from `/proc` by pid (tick
resolution, 10 ms on Linux: enough over a window of seconds).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far; None if it is gone or /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), counted from field 3
    return (utime + stime) / _CLOCK_TICKS_PER_S


def machine_cpu_s() -> tuple[float, float] | None:
    """(busy, stolen) CPU seconds of the whole machine so far, summed over cores; None without /proc.

    Busy is user + nice + system + irq + softirq; stolen is time the hypervisor
    ran someone else on our virtual cores. Busy minus this run's processes is
    what other work on the (shared) machine took.
    """
    try:
        with open("/proc/stat", "rb") as f:
            first = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    return (user + nice + system + irq + softirq) / _CLOCK_TICKS_PER_S, steal / _CLOCK_TICKS_PER_S


def procs_cpu_s(pids: Sequence[int]) -> list[float | None]:
    return [proc_cpu_s(pid) for pid in pids]


@dataclass(frozen=True)
class CpuSnapshot:
    """Readings taken right after an engine `stats()` reply, on the client's clocks."""

    monotonic_s: float
    client_cpu_s: float  # this (benchmark client) process
    stage_cpu_s: list[float | None]  # per pp_rank, from /proc
    machine_cpu_s: tuple[float, float] | None  # (busy, stolen) over every core

    @staticmethod
    def take(stage_pids: Sequence[int]) -> "CpuSnapshot":
        return CpuSnapshot(time.monotonic(), time.process_time(), procs_cpu_s(stage_pids), machine_cpu_s())


def cpu_figures(cpu_s: float | None, window_s: float, num_output_tokens: int) -> dict[str, Any]:
    """One process's CPU over the window: seconds, % of one core, µs per output token."""
    if cpu_s is None:
        return {"cpu_s": None, "core_pct": None, "cpu_us_per_output_token": None}
    return {
        "cpu_s": cpu_s,
        "core_pct": 100.0 * cpu_s / window_s if window_s > 0 else None,
        "cpu_us_per_output_token": 1e6 * cpu_s / num_output_tokens if num_output_tokens > 0 else None,
    }


def window_cpu(
    before: float | None, after: float | None, window_s: float, num_output_tokens: int
) -> dict[str, Any]:
    """`cpu_figures` of the growth between two readings (None if either is missing)."""
    used = None if before is None or after is None else after - before
    return cpu_figures(used, window_s, num_output_tokens)
