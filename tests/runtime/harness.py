"""Start `python -m asyncpp.launch` as a real subprocess for tests and find its address."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from asyncpp.bench.runs import to_toml


def tiny_sections(model_dir: Path | str, pp_size: int = 1, layer_split: tuple[int, ...] = (), **overrides) -> dict:
    sections = {
        "model": {"source": "hf", "path": str(model_dir), "dtype": "float32", "max_model_len": 256},
        "parallel": {"pp_size": pp_size, "layer_split": list(layer_split), "num_threads": 1},
        "cache": {"block_size": 16, "kv_cache_memory_mb": 8},
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 512},
        "server": {"host": "127.0.0.1", "port": 0, "grace_period_s": 2.0},
    }
    for section, values in overrides.items():
        sections.setdefault(section, {}).update(values)
    return sections


def real_sections(pp_size: int, shift_layers: int = 0) -> dict:
    """The real SmolLM2 (bfloat16, from its GGUF file) at `pp_size`; `shift_layers` lets the boundary move per step."""
    return {
        "model": {"source": "gguf", "path": "", "dtype": "bfloat16", "max_model_len": 512},
        "parallel": {"pp_size": pp_size, "num_threads": 1, "shift_layers": shift_layers},
        "cache": {"block_size": 16, "kv_cache_memory_mb": 64},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
        "server": {"host": "127.0.0.1", "port": 0, "grace_period_s": 2.0},
    }


class LaunchedEngine:
    def __init__(self, proc: subprocess.Popen, address: str, log_file: Path) -> None:
        self.proc = proc
        self.address = address
        self.log_file = log_file
        self.output: list[str] = []

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def launched(
    tmp_path: Path, sections: dict, *extra_args: str, ready_timeout_s: float = 180.0, module: str = "asyncpp.launch"
) -> Iterator[LaunchedEngine]:
    """`python -m module` (the launcher, or a test's wrapper of it) on `sections`; SIGTERM at the end."""
    config = tmp_path / "engine.toml"
    config.write_text(to_toml(sections))
    log_file = tmp_path / "engine.jsonl"
    cmd = [
        sys.executable, "-m", module, "--config", str(config),
        "--log-file", str(log_file), "--log-level", "debug", *extra_args,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()
    address: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"clients connect to (\S+)", line)
            if m and not address:
                address.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("engine not ready:\n" + "".join(lines))
    if not address:
        proc.wait(timeout=10)
        raise RuntimeError(f"engine exited with {proc.returncode} before ready:\n" + "".join(lines))
    engine = LaunchedEngine(proc, address[0], log_file)
    engine.output = lines
    try:
        yield engine
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM a launcher still running (it drains and cleans up), SIGKILL it past `timeout_s`; reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is reaped by its parent, so check its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def shm_segments(run_marker: str = "asyncpp-") -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{run_marker}*"))
