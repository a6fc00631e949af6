"""CPU-time readings of the serve benchmark: /proc parsing and the per-token figures."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from asyncpp.bench.cpu import CpuSnapshot, cpu_figures, machine_cpu_s, proc_cpu_s, window_cpu

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_proc_cpu_matches_process_time():
    before_proc, before_self = proc_cpu_s(os.getpid()), time.process_time()
    _burn(0.3)
    used_proc, used_self = proc_cpu_s(os.getpid()) - before_proc, time.process_time() - before_self
    assert used_proc == pytest.approx(used_self, abs=0.05)  # /proc counts in 10 ms ticks


def test_proc_cpu_reads_another_process_with_spaces_in_its_name():
    # The command name is "(...)" in /proc/<pid>/stat and may hold spaces and parentheses.
    code = (
        "import time\n"
        "open('/proc/self/comm', 'w').write('a (b) c')\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while (proc_cpu_s(child.pid) or 0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b"(a (b) c)" in f.read()
        assert 0.25 <= proc_cpu_s(child.pid) < 5
    finally:
        child.kill()
        child.wait()
    assert proc_cpu_s(child.pid) is None  # reaped: gone


def test_machine_cpu_grows_with_our_work():
    busy0, _ = machine_cpu_s()
    _burn(0.3)
    busy1, stolen1 = machine_cpu_s()
    assert busy1 - busy0 >= 0.25 and stolen1 >= 0


def test_snapshot_reads_every_stage():
    snap = CpuSnapshot.take([os.getpid(), os.getpid()])
    assert len(snap.stage_cpu_s) == 2 and all(s > 0 for s in snap.stage_cpu_s)
    assert snap.client_cpu_s > 0 and snap.machine_cpu_s is not None


def test_figures_per_core_and_per_token():
    assert cpu_figures(0.5, 2.0, 1000) == {"cpu_s": 0.5, "core_pct": 25.0, "cpu_us_per_output_token": 500.0}
    assert window_cpu(1.0, 1.5, 2.0, 1000) == cpu_figures(0.5, 2.0, 1000)
    assert window_cpu(None, 1.5, 2.0, 1000)["cpu_s"] is None
    assert cpu_figures(0.5, 0.0, 0) == {"cpu_s": 0.5, "core_pct": None, "cpu_us_per_output_token": None}
