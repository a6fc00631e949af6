"""What both launch modes start next to the engine (or router): the HTTP front end, a one-shot answer, the client port.

`asyncpp.launch` (one engine) and `asyncpp.disagg.deploy` (two engines behind a
router) share these; neither imports the other for them. Both ports are
taken before the model loads: the client port is bound then
(`bind_client_port`), the HTTP port is tried (`check_http_port`); a port in
use is a `ConfigError` naming its key (exit 2). The HTTP server is a child
that dies with the launcher (a SIGKILLed launcher leaves no server holding
the port, serving nobody) and serves only this launch's engine run
(`--engine-id`); the launcher waits for the child itself to say it listens.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import sys

from asyncpp.client import AsyncClient
from asyncpp.config import ConfigError, EngineConfig
from asyncpp.logging import get_logger
from asyncpp.runtime.parent_death import preexec_dying_with_parent
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_auth import ClientAccess, new_secret
from asyncpp.wire.queues import RouterQueue

HTTP_READY_TIMEOUT_S = 120.0


def http_url(config: EngineConfig) -> str:
    host = config.server.http_host
    return f"http://{'[' + host + ']' if ':' in host else host}:{config.server.http_port}"


def port_error(key: str, host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"{key} {port} on {host} is already in use"
    return f"{key} {port} on {host} cannot be bound: {e.strerror or e}"


def bind_client_port(host: str, port: int, max_frame_bytes: int, access: ClientAccess) -> RouterQueue:
    """The client port (`server.port`; 0: any free one), bound now; `ConfigError` naming it if it cannot be."""
    try:
        return RouterQueue(f"tcp://{host}:{port}", max_frame_bytes, access)
    except OSError as e:
        raise ConfigError(port_error("server.port", host, port, e)) from None


def check_http_port(config: EngineConfig) -> None:
    """`ConfigError` naming server.http_port if it is set and cannot be bound now (bound and let go:
    the HTTP server binds it once the engine is ready)."""
    s = config.server
    if not s.http_port:
        return
    try:
        infos = socket.getaddrinfo(s.http_host, s.http_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"server.http_host {s.http_host!r}: {e.strerror}") from None
    probes: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in infos:  # every address the server will listen on
            probe = socket.socket(family, kind, proto)
            probes.append(probe)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed port's TIME_WAIT is free
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
    except OSError as e:
        raise ConfigError(port_error("server.http_port", s.http_host, s.http_port, e)) from None
    finally:
        for probe in probes:
            probe.close()


async def start_http(
    config_path: str, config: EngineConfig, engine_address: str, engine_id: str
) -> asyncio.subprocess.Process:
    """Start `python -m asyncpp.http` for the engine run `engine_id`, dying with this process, and wait
    until it says it listens; `ConfigError` naming server.http_port if it exits before."""
    s = config.server
    read_fd, write_fd = os.pipe()
    args = [sys.executable, "-m", "asyncpp.http", "--config", config_path, "--engine", engine_address,
            "--engine-id", engine_id, "--ready-fd", str(write_fd),
            "--host", s.http_host, "--port", str(s.http_port), "--log-level", "warning"]  # fmt: skip
    if s.api_key:
        args += ["--api-key", s.api_key]
    try:  # SIGKILL: the engine it serves dies with us, so its open requests could not finish anyway
        proc = await asyncio.create_subprocess_exec(
            *args, pass_fds=(write_fd,), preexec_fn=preexec_dying_with_parent(signal.SIGKILL)
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # the child's copy is the only one: its exit is the pipe's end
    get_logger(role="launch").info("http_started", pid=proc.pid, url=http_url(config))
    try:
        said = await asyncio.wait_for(_read_line(read_fd), HTTP_READY_TIMEOUT_S)
    except TimeoutError:
        await _kill(proc)
        url, limit_s = http_url(config), HTTP_READY_TIMEOUT_S
        raise RuntimeError(f"the HTTP server did not listen on {url} within {limit_s:.0f} s") from None
    if said != b"listening\n":  # it exited (or is exiting) first
        try:
            code = await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            await _kill(proc)
            code = proc.returncode
        raise ConfigError(
            f"server.http_port {s.http_port} on {s.http_host}: the HTTP server exited with code {code} before it "
            "listened (its own lines above say why)"
        )
    return proc


async def _read_line(fd: int) -> bytes:
    """One line from the pipe `fd` (b"" at its end); the pipe is closed after."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    try:
        return await reader.readline()
    finally:
        transport.close()


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


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


