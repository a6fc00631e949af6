"""What both launch modes start next to the serving engine (or router): the HTTP front end, a one-shot answer, and the client port's access.

`asyncpp.launch` (one engine) and `asyncpp.disagg.deploy` (two engines behind a
router) share these; neither imports the other for them.
"""

from __future__ import annotations

import asyncio
import sys
import time

from asyncpp.client import AsyncClient
from asyncpp.config import EngineConfig
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_auth import ClientAccess, new_secret

HTTP_READY_TIMEOUT_S = 120.0


def http_url(config: EngineConfig) -> str:
    host = config.server.http_host
    return f"http://{'[' + host + ']' if ':' in host else host}:{config.server.http_port}"


async def start_http(config_path: str, config: EngineConfig, engine_address: str, ns) -> asyncio.subprocess.Process:
    """Start `python -m asyncpp.http` and wait until its port accepts connections."""
    s = config.server
    args = [sys.executable, "-m", "asyncpp.http", "--config", config_path, "--engine", engine_address,
            "--host", s.http_host, "--port", str(s.http_port), "--log-level", "warning"]  # fmt: skip
    if s.api_key:
        args += ["--api-key", s.api_key]
    proc = await asyncio.create_subprocess_exec(*args)
    deadline = time.monotonic() + HTTP_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"the HTTP server exited with {proc.returncode} at start-up")
        try:
            _, writer = await asyncio.open_connection(s.http_host, s.http_port)
            writer.close()
            return proc
        except OSError:
            await asyncio.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the HTTP server did not listen on {http_url(config)} within {HTTP_READY_TIMEOUT_S:.0f} s")


async def stop_http(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def client_access(config: EngineConfig) -> ClientAccess:
    """Who the client port lets in: the configured client secret; the engine role with the configured
    engine secret, or one made up for this run (then only this launch's own could hold it)."""
    s = config.server
    return ClientAccess(s.client_secret, s.engine_secret or new_secret())


async def one_shot(address: str, prompt: str, max_tokens: int, client_secret: str = "") -> bool:
    client = AsyncClient(address, secret=client_secret)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        async for out in client.generate([{"role": "user", "content": prompt}], params):
            print(out.text, end="", flush=True)
        print(flush=True)
        return True
    except Exception as e:  # noqa: BLE001 - reported, and the exit code says it failed
        print(f"\nerror: {e}", file=sys.stderr, flush=True)
        return False
    finally:
        client.close()


