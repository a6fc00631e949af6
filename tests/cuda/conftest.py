"""The CUDA tests' process cleans up after itself in /dev/shm.

The CUDA driver keeps the interprocess events a process made in
`/dev/shm/cuda.shm.<device>.<pid in hex>.<n>` past its exit (H200,
2026-11-28: the one file left after `tests/cuda` was this process's, pid
0x202, from the CUDA IPC ring tests' receivers). The launcher unlinks its
stages' once it has reaped them (`unlink_torch_shm`); this does the same for
the test process at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def pytest_sessionfinish(session, exitstatus) -> None:
    for path in Path("/dev/shm").glob(f"cuda.shm.*.{os.getpid():x}.*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
