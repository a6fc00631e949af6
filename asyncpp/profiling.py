"""Opt-in cProfile of a process's hot loop, for finding where its CPU time goes.

Off unless `ASYNCPP_PROFILE_DIR` names a directory; then
`profiled("engine")` writes `engine-<pid>.prof` there when the block exits
(read it with `python -m pstats FILE` or snakeviz). The engine wraps its
serving loop in it, each stage process its step loop (`stage<rank>-<pid>.prof`)
and the serve benchmark its client, so

    ASYNCPP_PROFILE_DIR=/tmp/prof python -m asyncpp.bench ...

profiles all of them under load. Times are the profiled thread's CPU time
(`time.thread_time`), not wall time: on a loaded machine a wall-clock
profile charges a function for the time the thread sat descheduled in it
(a socket send that wakes another thread, say). Set `ASYNCPP_PROFILE_CLOCK=wall`
for wall time. Profiling slows the process down: never compare the CPU
figures of a profiled run with an unprofiled one.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import time
from collections.abc import Iterator
from pathlib import Path

ENV_VAR = "ASYNCPP_PROFILE_DIR"
CLOCK_ENV_VAR = "ASYNCPP_PROFILE_CLOCK"
_CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


@contextlib.contextmanager
def profiled(role: str) -> Iterator[Path | None]:
    """Profile the block when `ASYNCPP_PROFILE_DIR` is set; yields the output path (None when off)."""
    directory = os.environ.get(ENV_VAR)
    if not directory:
        yield None
        return
    clock = os.environ.get(CLOCK_ENV_VAR, "cpu")
    if clock not in _CLOCKS:
        raise ValueError(f"{CLOCK_ENV_VAR} must be one of {sorted(_CLOCKS)}, got {clock!r}")
    path = Path(directory) / f"{role}-{os.getpid()}.prof"
    path.parent.mkdir(parents=True, exist_ok=True)
    profile = cProfile.Profile(_CLOCKS[clock])
    profile.enable()
    try:
        yield path
    finally:
        profile.disable()
        profile.dump_stats(path)
