"""A subprocess started with `preexec_dying_with_parent` is gone soon after its parent is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.runtime.conftest import wait_until
from tests.runtime.harness import pid_alive

PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from asyncpp.runtime.parent_death import preexec_dying_with_parent

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             preexec_fn=preexec_dying_with_parent(signal.SIGKILL))
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux facility")
def test_the_child_dies_with_its_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        assert pid_alive(child_pid)
        parent.kill()
        parent.wait(timeout=10)
        took_s = wait_until(lambda: not pid_alive(child_pid), 2, "the orphaned child gone")
        print(f"\nchild gone {took_s:.3f} s after its parent was killed")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child_pid is not None and pid_alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
