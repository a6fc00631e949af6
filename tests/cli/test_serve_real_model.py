"""`asyncpp serve` (the installed console script) on the real model answers the official `openai` client:
chat and completions, streamed and not, under the served model name and API key it was given, on two
pipeline stages; the same greedy answer as the engine's own client."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncpp.client import AsyncClient
from tests.runtime.conftest import collect
from tests.runtime.harness import stop
from tests.runtime.test_real_model_pp import GREEDY

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
CHAT = [{"role": "user", "content": "Name three colors."}]
READY_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(*argv: str) -> Iterator[tuple[str, list[str]]]:
    """`asyncpp serve ARGV` until its ready line: (the engine's client address, its output so far); SIGTERM after."""
    script = Path(sys.executable).with_name("asyncpp")
    proc = subprocess.Popen([str(script), "serve", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    address: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if (m := re.search(r"clients connect to (\S+)", line)) and not address:
                address.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.wait(0.1) and time.monotonic() < deadline:
        pass
    try:
        assert address, f"asyncpp serve exited with {proc.poll()} or was not ready:\n" + "".join(lines)
        yield address[0], lines
    finally:
        stop(proc)
    assert proc.returncode == 0, "".join(lines[-30:])


async def _stream_text(stream) -> str:
    parts = []
    async for chunk in stream:
        delta = chunk.choices[0].delta.content if hasattr(chunk.choices[0], "delta") else chunk.choices[0].text
        parts.append(delta or "")
    return "".join(parts)


async def test_asyncpp_serve_answers_the_openai_client_on_two_stages():
    port = free_port()
    with served("--port", str(port), "-pp", "2", "--served-model-name", "smol", "--api-key", "sekrit") as (address, lines):
        assert any(f"OpenAI API on http://127.0.0.1:{port}/v1" in line for line in lines)
        client = AsyncClient(address)
        try:
            _, native, _ = await asyncio.wait_for(collect(client, CHAT, GREEDY), 120)
            stats = await client.stats()
        finally:
            client.close()
        assert len(stats["stage_pids"]) == 2
        oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit")
        assert [m.id for m in (await oai.models.list()).data] == ["smol"]
        kwargs = {"model": "smol", "max_tokens": GREEDY.max_tokens, "temperature": 0}
        chat = await oai.chat.completions.create(messages=CHAT, **kwargs)
        streamed = await _stream_text(await oai.chat.completions.create(messages=CHAT, stream=True, **kwargs))
        assert chat.choices[0].message.content == streamed == native
        completion = await oai.completions.create(prompt="The capital of France is", **kwargs)
        streamed = await _stream_text(await oai.completions.create(prompt="The capital of France is", stream=True, **kwargs))
        assert completion.choices[0].text == streamed and streamed
        stranger = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
