"""Router fixtures: two fake engines (`tests.disagg.fakes`) and a `PDRouter` in front, in-process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest

from asyncpp.client import AsyncClient
from asyncpp.disagg.link import EngineLink
from asyncpp.disagg.router import PDRouter
from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.wire.queues import RouterQueue
from tests.disagg.fakes import ENGINE_SECRET, FakeEngine

PREFILL_HANDSHAKE = EngineHandshake("prefill-0", 1, [])
DECODE_HANDSHAKE = EngineHandshake("decode-0", 1, [])


class FakeEnginesSetup:
    """A router in front of fake engines, its clients; `close` stops them all."""

    def __init__(self, engines: list[FakeEngine], router) -> None:
        self.engines = engines
        self.router = router
        self.clients: list[AsyncClient] = []
        self.serving: asyncio.Task | None = None

    def client(self) -> AsyncClient:
        client = AsyncClient(self.router.address)
        self.clients.append(client)
        return client

    async def close(self) -> None:
        await self.router.drain_and_stop(0.0)
        if self.serving is not None:
            await self.serving
        await self.router.close()
        for client in self.clients:
            client.close()
        for engine in self.engines:
            engine.close()


class RouterSetup(FakeEnginesSetup):
    def __init__(self, prefill: FakeEngine, decode: FakeEngine, router: PDRouter) -> None:
        super().__init__([prefill, decode], router)
        self.prefill = prefill
        self.decode = decode


def make_router(prefill: FakeEngine, decode: FakeEngine, **health) -> PDRouter:
    queue = RouterQueue("tcp://127.0.0.1:0", 1 << 20)
    links = [EngineLink(role, engine.address, engine_secret=ENGINE_SECRET, **health) for role, engine in (("prefill", prefill), ("decode", decode))]
    return PDRouter(queue, *links)


@contextlib.asynccontextmanager
async def serving(decode_handshake: EngineHandshake | None):
    """Fake engines (the prefill one publishes a handshake) and a connected, serving router with
    the default health settings (a check every 0.5 s, 1 s timeout)."""
    setup = RouterSetup(
        FakeEngine("prefill", PREFILL_HANDSHAKE).start(), FakeEngine("decode", decode_handshake).start(), None
    )
    setup.router = make_router(setup.prefill, setup.decode)
    await setup.router.connect(5.0)
    setup.serving = asyncio.create_task(setup.router.serve())
    try:
        yield setup
    finally:
        await setup.close()


@pytest.fixture
async def pd():
    """The decode engine publishes no handshake: the router hands over after the prefill."""
    async with serving(None) as setup:
        yield setup


@pytest.fixture
async def pd_early():
    """Both engines publish handshakes: the router hands over early."""
    async with serving(DECODE_HANDSHAKE) as setup:
        yield setup


async def until(is_done: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> float:
    """Poll `is_done` on the loop; the seconds it took."""
    t0 = time.monotonic()
    while not is_done():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0
