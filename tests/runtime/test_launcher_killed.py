"""A launcher killed with SIGKILL (no chance to clean up) takes its stages with it: no orphans, no shm left."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from pathlib import Path

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.runtime.conftest import wait_until
from tests.runtime.harness import launched, pid_alive, shm_segments, tiny_sections

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


async def test_stages_die_with_a_killed_launcher(tmp_path, tiny_hf_dir):
    with launched(tmp_path, tiny_sections(tiny_hf_dir, 2, (2, 2))) as engine:
        client = AsyncClient(engine.address)
        try:
            stats = await client.stats()
            pids, run_id = stats["stage_pids"], stats["run_id"]
            assert len(shm_segments(f"asyncpp-{run_id}")) == 1
            # Mid-stream, so the stages are busy (and would block on each other once orphaned).
            tokens = asyncio.create_task(anext(aiter(client.generate(tiny_prompts(320, 1)[0], LONG))))
            await asyncio.wait_for(tokens, timeout=30)
            engine.proc.send_signal(signal.SIGKILL)
            assert engine.wait(timeout_s=10) == -signal.SIGKILL
        finally:
            client.close()
        try:
            took_s = wait_until(lambda: not any(pid_alive(p) for p in pids), 5, "orphaned stages gone")
        finally:
            for pid in pids:  # never leave an orphan behind, even when the check fails
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        print(f"\nstages gone {took_s:.2f} s after the launcher was killed")
        try:
            # The multiprocessing resource tracker unlinks the ring once the last stage is gone.
            wait_until(lambda: not shm_segments(f"asyncpp-{run_id}"), 5, "ring unlinked")
        finally:
            _remove_run_dirs(run_id)


def _remove_run_dirs(run_id: str) -> None:
    """The killed launcher's socket directory: nothing that survives it can remove it, so the test does."""
    for run_dir in Path(tempfile.gettempdir()).glob(f"asyncpp-{run_id}-*"):
        shutil.rmtree(run_dir, ignore_errors=True)
