"""A launcher killed with SIGKILL (no chance to clean up) takes its stages and its HTTP server with it:
no orphans, no shm left, the HTTP port free for the next launch."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import httpx

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.http.idle_checks import PROMPT, served_and_nothing_held
from tests.http.test_openai_server import free_port
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


async def test_the_http_server_dies_with_a_killed_launcher_and_the_next_launch_gets_its_port(tmp_path, tiny_hf_dir):
    """The orphaned HTTP server used to keep the port, answer no request, and serve the next engine
    started at the same address, whatever that launch's API key."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    body = {"prompt": PROMPT, "max_tokens": 3}
    async with asyncio.timeout(300):
        (tmp_path / "first").mkdir()
        pids: list[int] = []
        run_id = None
        with launched(tmp_path / "first", tiny_sections(tiny_hf_dir, 1, server={"http_port": port})) as engine:
            try:
                http_pid = _http_pid(engine.log_file)
                pids.append(http_pid)
                client = AsyncClient(engine.address)
                try:
                    stats = await client.stats()
                finally:
                    client.close()
                pids, run_id = pids + stats["stage_pids"], stats["run_id"]
                async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
                    assert (await http.post("/v1/completions", json=body)).status_code == 200
                engine.proc.send_signal(signal.SIGKILL)
                assert engine.wait(timeout_s=10) == -signal.SIGKILL
                took_s = wait_until(lambda: not pid_alive(http_pid), 2, "the orphaned HTTP server gone")
            finally:
                for pid in pids:  # never leave an orphan behind, even when the check fails
                    if pid_alive(pid):
                        os.kill(pid, signal.SIGKILL)
                if run_id is not None:
                    _remove_run_dirs(run_id)
        print(f"\nHTTP server gone {took_s:.3f} s after the launcher was killed")

        (tmp_path / "second").mkdir()
        sections = tiny_sections(tiny_hf_dir, 1, server={"http_port": port, "api_key": "s3cret"})
        with launched(tmp_path / "second", sections) as engine:
            assert any(f"OpenAI API on {base_url}/v1" in line for line in engine.output), engine.output
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            await served_and_nothing_held(base_url, {"Authorization": "Bearer s3cret"})


def _http_pid(log_file: Path) -> int:
    """The launcher's HTTP server, as its log names it."""
    for line in log_file.read_text().splitlines():
        if '"http_started"' in line:
            return json.loads(line)["pid"]
    raise AssertionError("no http_started event in the launcher's log")


def _remove_run_dirs(run_id: str) -> None:
    """The killed launcher's socket directory: nothing that survives it can remove it, so the test does."""
    for run_dir in Path(tempfile.gettempdir()).glob(f"asyncpp-{run_id}-*"):
        shutil.rmtree(run_dir, ignore_errors=True)
