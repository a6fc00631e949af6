"""The HTTP server serves one engine run: a 503 within seconds while it cannot reach it, never another run.

ZMQ reconnects to whatever listens at the engine's address; an HTTP server
left behind by its engine used to wait forever on every request, then serve
the next engine started there. Here an engine is killed under a server
started by hand, another is started at the same address, and the server
must refuse it and stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.input_processor import InputProcessor
from asyncpp.http.app import HttpSettings, build_app
from asyncpp.http.engine_guard import ENGINE_WAIT_S
from asyncpp.tokenizer import load_tokenizer
from tests.http.idle_checks import PROMPT, served_and_nothing_held
from tests.http.test_openai_server import free_port
from tests.runtime.harness import launched, pid_alive, tiny_sections

LONG = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
DEADLINE_S = 30.0  # liveness only


async def test_a_request_for_an_engine_never_reached_is_a_503_within_the_wait(tiny_hf_dir):
    """The app in process, its engine's address one where nothing listens."""
    tokenizer = load_tokenizer("hf", str(tiny_hf_dir), 320)
    settings = HttpSettings(f"tcp://127.0.0.1:{free_port()}", "tiny", 256)
    app = build_app(settings, InputProcessor(tokenizer, 320, 256))
    async with asyncio.timeout(60), app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            t0 = time.monotonic()
            r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            took_s = time.monotonic() - t0
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
            assert ENGINE_WAIT_S - 0.5 < took_s < ENGINE_WAIT_S + 2.0
            assert (await http.get("/health")).status_code == 503


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stages die with a killed launcher on Linux")
async def test_a_server_serves_only_its_own_engine_run(tmp_path, tiny_hf_dir):
    port = free_port()
    engine_sections = tiny_sections(tiny_hf_dir, 1, server={"port": port})
    leftovers: list[int] = []
    stats: dict = {}
    try:
        async with asyncio.timeout(300):
            (tmp_path / "first").mkdir()
            with launched(tmp_path / "first", engine_sections) as first:
                stats = await _stats(first.address)
                leftovers += stats["stage_pids"]
                config = first.log_file.parent / "engine.toml"

                # Started for another run: never serves this one, and stops.
                another = ("--engine-id", "another-run")
                with http_server(tmp_path, config, first.address, *another, must_listen=False) as server:
                    with contextlib.suppress(httpx.TransportError):  # (it may be gone already)
                        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
                            r = await http.post("/v1/completions", json=LONG)
                            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
                    assert server.wait(timeout=DEADLINE_S) == 1
                    assert f"is run '{stats['run_id']}', not 'another-run'" in server.stderr(), server.stderr()

                # Started by hand without one: it serves the first run it reaches ...
                with http_server(tmp_path, config, first.address) as server:
                    await served_and_nothing_held(server.base_url)
                    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
                        # ... a stream open when that engine is killed ends at once with engine_dead ...
                        async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                            lines = aiter(r.aiter_lines())
                            while not (await anext(lines)).startswith("data: "):
                                pass
                            first.proc.send_signal(signal.SIGKILL)
                            t0 = time.monotonic()
                            payloads = [line[6:] async for line in lines if line.startswith("data: ")]
                            ended_s = time.monotonic() - t0
                        assert payloads[-1] == "[DONE]", payloads[-3:]
                        assert json.loads(payloads[-2])["error"]["code"] == "engine_dead", payloads[-2]
                        assert ended_s < 2.0
                        # ... a new request gets a 503 within the wait, not never ...
                        t0 = time.monotonic()
                        r = await http.post("/v1/completions", json=LONG)
                        took_s = time.monotonic() - t0
                        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
                        assert took_s < ENGINE_WAIT_S + 2.0
                        assert (await http.get("/health")).status_code == 503
                    print(f"\nstream ended {ended_s:.3f} s after its engine was killed; a new 503 took {took_s:.2f} s")

                    # ... and when another engine takes the address, it stops instead of serving it.
                    (tmp_path / "second").mkdir()
                    http_port = free_port()
                    second_sections = tiny_sections(tiny_hf_dir, 1, server={"port": port, "http_port": http_port})
                    with launched(tmp_path / "second", second_sections) as second:
                        assert second.address == first.address
                        assert server.wait(timeout=DEADLINE_S) == 1
                        assert "which this server was started for" in server.stderr(), server.stderr()
                        await served_and_nothing_held(f"http://127.0.0.1:{http_port}")
    finally:
        for pid in leftovers:  # the killed engine's stages die with it; never leave one behind
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if stats:
            for run_dir in Path(tempfile.gettempdir()).glob(f"asyncpp-{stats['run_id']}-*"):
                shutil.rmtree(run_dir, ignore_errors=True)


async def _stats(address: str) -> dict:
    client = AsyncClient(address)
    try:
        return await client.stats()
    finally:
        client.close()


class _Server:
    def __init__(self, proc: subprocess.Popen, base_url: str, stderr_path: Path) -> None:
        self.proc, self.base_url, self.stderr_path = proc, base_url, stderr_path

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stderr(self) -> str:
        return self.stderr_path.read_text()


@contextlib.contextmanager
def http_server(tmp_path: Path, config: Path, address: str, *args: str, must_listen: bool = True):
    """`python -m asyncpp.http` by hand, once it says it listens (or, unless `must_listen`, has exited);
    killed at the end if still running."""
    port = free_port()
    read_fd, write_fd = os.pipe()
    stderr_path = tmp_path / f"http-{port}.log"
    cmd = [sys.executable, "-m", "asyncpp.http", "--config", str(config), "--engine", address, "--port", str(port),
           "--ready-fd", str(write_fd), *args]  # fmt: skip
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cmd, pass_fds=(write_fd,), stderr=stderr)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            assert select.select([ready], [], [], 2 * DEADLINE_S)[0], "the HTTP server did not start"
            said = ready.readline()
        assert said == b"listening\n" or (not must_listen and said == b""), stderr_path.read_text()
        yield _Server(proc, f"http://127.0.0.1:{port}", stderr_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
