"""How many CPUs the engine's processes may count on: `SpareCpus`, read from /proc.

Those this process may run on, less what other work on the machine took
lately. The engine lends a lone cohort's steps only cores nobody else uses
(`parallel.lend_idle_threads`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from asyncpp.runtime.cpu_affinity import usable_cpu_ids


class SpareCpus:
    """CPUs free for our processes (`pids`), measured over the last `interval_s`; Linux /proc.

    Busy time of the CPUs this process may run on (/proc/stat, hypervisor steal
    included) minus our processes' CPU time (/proc/<pid>/stat) is what other
    work took. A step run with lent threads while another process holds a core
    waits for the descheduled thread in every parallel region: several times
    slower than one thread. Without /proc every CPU counts as spare.
    """

    def __init__(self, pids: Sequence[int], interval_s: float = 0.5) -> None:
        self.pids = list(pids)
        self.interval_s = interval_s
        self.cpu_ids = usable_cpu_ids()
        self.num_spare = float(len(self.cpu_ids))
        self._last = self._read()
        self._next_at = time.monotonic() + interval_s

    def track(self, pids: Sequence[int]) -> None:
        """Our processes are now `pids` (the stages restarted): measure from here on."""
        self.pids = list(pids)
        self._last = self._read()

    def refresh(self, now: float) -> float:
        """The spare CPUs, read again once `interval_s` has passed since the last reading."""
        if now < self._next_at:
            return self.num_spare
        self._next_at = now + self.interval_s
        reading = self._read()
        if reading is not None and self._last is not None:
            (t0, busy0, ours0), (t1, busy1, ours1) = self._last, reading
            if t1 > t0:
                num_others = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (t1 - t0)
                self.num_spare = max(0.0, len(self.cpu_ids) - num_others)
        self._last = reading
        return self.num_spare

    def _read(self) -> tuple[float, float, float] | None:
        """(monotonic s, busy CPU s of our CPUs, CPU s of our processes), or None without /proc."""
        try:
            with open("/proc/stat", "rb") as f:
                lines = f.read().splitlines()
            ours = sum(_proc_cpu_ticks(pid) for pid in self.pids)
        except (OSError, ValueError, IndexError):
            return None
        wanted = {b"cpu%d" % i for i in self.cpu_ids}
        busy = 0
        for line in lines:
            fields = line.split()
            if fields and fields[0] in wanted:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
                busy += user + nice + system + irq + softirq + steal
        return time.monotonic(), busy / _CLOCK_TICKS_PER_S, ours / _CLOCK_TICKS_PER_S


_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_ticks(pid: int) -> int:
    """User + system clock ticks of process `pid`, all threads (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return 0
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name (field 2) may hold spaces and ')'
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
