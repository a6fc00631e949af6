"""`python -m tests.runtime.idle_machine_launch`: the launcher on a machine that looks idle.

The engine lends threads only on cores nobody else uses, and the machine
running the tests is shared: here `SpareCpus` reads no busy time at all, so
every CPU this process may use counts as spare and a lone cohort is always
lent its stages' threads. Everything else is the real launcher.
"""

from __future__ import annotations

import sys
import time

from asyncpp.launch import main
from asyncpp.runtime.spare_cpus import SpareCpus


def _idle_reading(self) -> tuple[float, float, float]:
    return time.monotonic(), 0.0, 0.0  # (monotonic s, busy CPU s, CPU s of ours): nobody else ran


if __name__ == "__main__":
    SpareCpus._read = _idle_reading
    sys.exit(main())
