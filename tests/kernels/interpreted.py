"""Running a module of Triton kernel checks on CPU under Triton's interpreter, and the checks' runner.

The interpreter is chosen when a kernel is defined, so it cannot be switched on in the test
process: `run_interpreted(module)` runs the module's checks in a subprocess with
`TRITON_INTERPRET=1` (the module calls `main(CHECKS)` when run as a script), and on a GPU the
test files call the same check functions on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, num_checks: int, timeout: float = 600) -> None:
    """Every check of `module` (dotted name) passes under the interpreter on CPU."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", module, "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == num_checks, proc.stdout


def main(checks: list[Callable[[str], None]]) -> None:
    """A checks module run as a script: each check on the device named first (default cpu)."""
    for check in checks:
        check(sys.argv[1] if len(sys.argv) > 1 else "cpu")
        print(f"{check.__name__}: ok", flush=True)
