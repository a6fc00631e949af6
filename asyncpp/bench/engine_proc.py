"""Launch `python -m asyncpp.launch` for one benchmark run and always shut it down.

`launched_engine(config_path)` starts the launcher in its own session (so a
Ctrl-C in the terminal reaches the benchmark, which then stops the engine in
order), waits for the `clients connect to ADDRESS` line, yields an
`EngineProcess`, and on exit — normal, error or KeyboardInterrupt — sends
SIGTERM and waits; SIGKILL only if the engine outlives its grace period.
The launcher's output is kept (last lines) for error messages.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

READY_RE = re.compile(r"clients connect to (\S+)")
NUM_TAIL_LINES = 60


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    address: str
    output_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=NUM_TAIL_LINES))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self) -> str:
        return "".join(self.output_tail)


@contextlib.contextmanager
def launched_engine(
    config_path: str | Path,
    *,
    ready_timeout_s: float = 600.0,
    stop_timeout_s: float = 60.0,
    log_level: str = "warning",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    tree: Path | None = None,
) -> Iterator[EngineProcess]:
    """`extra_args`: more launcher flags (`--log-file F`); `env`: variables added to this process's;
    `tree`: a checkout of asyncpp to run instead of this one (first on the path, and the working
    directory, which `python -m` puts before it)."""
    cmd = [sys.executable, "-m", "asyncpp.launch", "--config", str(Path(config_path).resolve()), "--log-level", log_level, *extra_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True, cwd=tree
    )
    engine = EngineProcess(proc, address="")
    ready = threading.Event()
    threading.Thread(target=_pump, args=(engine, ready), daemon=True).start()
    try:
        _wait_ready(engine, ready, ready_timeout_s)
        yield engine
    finally:
        stop_engine(proc, stop_timeout_s)


def stop_engine(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM (the launcher drains, stops its stages, unlinks shared memory), wait, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the stages go too
        return proc.wait()


def _pump(engine: EngineProcess, ready: threading.Event) -> None:
    for line in engine.proc.stdout:
        engine.output_tail.append(line)
        if not engine.address:
            m = READY_RE.search(line)
            if m:
                engine.address = m.group(1)
                ready.set()
    ready.set()  # EOF: the launcher exited


def _wait_ready(engine: EngineProcess, ready: threading.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            raise EngineStartError(f"engine not ready within {timeout_s:.0f} s:\n{engine.tail()}")
    if not engine.address:
        engine.proc.wait(timeout=10)
        raise EngineStartError(f"engine exited with code {engine.proc.returncode} before ready:\n{engine.tail()}")
