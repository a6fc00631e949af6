"""A graceful shutdown ends what is open: streams with an error event and `[DONE]`, pending requests with a JSON 503.

Either side may be the one shutting down: the HTTP server (SIGTERM, or Ctrl-C
reaching it), or the engine behind it (the launcher's SIGTERM), whose drain
fails its unfinished requests with kind "shutdown". Each test starts its own
HTTP server by hand next to one launched engine (grace period 0), holds a
stream and a non-streamed request in flight by freezing the stage processes
(SIGSTOP) as soon as the stream has its first chunk, and shuts one side down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from asyncpp.client import AsyncClient
from tests.http.test_openai_server import free_port
from tests.runtime.conftest import collect, is_idle, poll_until
from tests.runtime.harness import launched, tiny_sections

PROMPT = "The quick brown fox jumps over the lazy dog. "
LONG = {"prompt": PROMPT, "max_tokens": 450, "temperature": 0, "ignore_eos": True}  # max_model_len 512
DEADLINE_S = 30.0  # liveness only


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_hf_dir):
    sections = tiny_sections(tiny_hf_dir, 1, model={"max_model_len": 512}, server={"grace_period_s": 0.0})
    with launched(tmp_path_factory.mktemp("http-shutdown"), sections) as e:
        yield e


@contextlib.contextmanager
def http_server(engine):
    port = free_port()
    config = engine.log_file.parent / "engine.toml"
    cmd = [sys.executable, "-m", "asyncpp.http", "--config", str(config), "--engine", engine.address, "--port", str(port)]
    proc = subprocess.Popen(cmd)
    proc.base_url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=proc.base_url) as http:
            for _ in range(int(DEADLINE_S * 10)):
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/health").status_code == 200:
                        break
                assert proc.poll() is None, "the HTTP server exited at start-up"
                time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@contextlib.contextmanager
def thawed_at_the_end(pids: list[int]):
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def stage_pids(address: str) -> list[int]:
    client = AsyncClient(address)
    try:
        return (await client.stats())["stage_pids"]
    finally:
        client.close()


async def open_requests(base_url: str, address: str, stages: list[int]):
    """A stream that has its first chunk and a non-streamed request, both in the engine, which cannot
    finish: the stages are frozen from the stream's first chunk on (the caller thaws them).
    Returns the stream's task (it collects the `data:` payloads) and the other's."""
    first = asyncio.Event()

    async def stream() -> list[str]:
        payloads = []
        async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as http:
            async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        payloads.append(line[6:])
                        first.set()
        return payloads

    async def whole() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as http:
            return await http.post("/v1/completions", json=LONG)

    streamed = asyncio.create_task(stream())
    await asyncio.wait_for(first.wait(), DEADLINE_S)
    for pid in stages:
        os.kill(pid, signal.SIGSTOP)
    pending = asyncio.create_task(whole())
    client = AsyncClient(address)
    try:
        await poll_until(client.stats, lambda s: s["num_running"] + s["num_waiting"] == 2, DEADLINE_S)
    finally:
        client.close()
    return streamed, pending


def assert_ended_by_shutdown(payloads: list[str], pending: httpx.Response) -> None:
    assert payloads[-1] == "[DONE]", payloads[-3:]
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "shutdown" and error["type"] == "ServiceUnavailableError", error
    assert pending.status_code == 503, pending.text
    assert pending.json()["error"]["code"] == "shutdown"


async def test_the_http_server_shutting_down_ends_open_requests_and_frees_them(engine):
    stages = await stage_pids(engine.address)
    with http_server(engine) as http_proc, thawed_at_the_end(stages):
        streamed, pending = await open_requests(http_proc.base_url, engine.address, stages)
        http_proc.send_signal(signal.SIGTERM)
        payloads, answer = await asyncio.wait_for(asyncio.gather(streamed, pending), DEADLINE_S)
        assert_ended_by_shutdown(payloads, answer)
        assert http_proc.wait(DEADLINE_S) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    client = AsyncClient(engine.address)
    try:
        await poll_until(client.stats, is_idle, DEADLINE_S)  # both aborted: nothing held
        tokens, _, reason = await collect(client, PROMPT, {"max_tokens": 3, "ignore_eos": True})
        assert len(tokens) == 3 and reason == "length"
        assert is_idle(await poll_until(client.stats, is_idle, DEADLINE_S))
    finally:
        client.close()


async def test_the_engine_shutting_down_ends_open_http_requests(engine):
    stages = await stage_pids(engine.address)
    with http_server(engine) as http_proc:
        with thawed_at_the_end(stages):  # no step completes, yet the engine drains: grace 0, then it fails both
            streamed, pending = await open_requests(http_proc.base_url, engine.address, stages)
            engine.proc.send_signal(signal.SIGTERM)
            payloads, answer = await asyncio.wait_for(asyncio.gather(streamed, pending), DEADLINE_S)
        assert_ended_by_shutdown(payloads, answer)
        assert engine.wait(DEADLINE_S) == 0
        async with httpx.AsyncClient(base_url=http_proc.base_url, timeout=DEADLINE_S) as http:
            assert (await http.get("/health")).status_code == 503  # the HTTP server outlives it, and says so
