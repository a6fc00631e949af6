"""Data-parallel router fixtures: fake replicas (`tests.disagg.fakes`, as whole engines) and a `DPRouter`, in-process."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.disagg.link import EngineLink
from asyncpp.dp.placement import LongPrompts
from asyncpp.dp.router import DPRouter
from asyncpp.wire.queues import RouterQueue
from tests.disagg.conftest import FakeEnginesSetup
from tests.disagg.fakes import ENGINE_SECRET, FakeEngine


STEP_BUDGET = 128  # the replicas' max_num_batched_tokens, as the router is told


def fake_replica(index: int) -> FakeEngine:
    """A fake whole engine: three deltas per request (`decode_deltas`), no KV params expected."""
    engine = FakeEngine(f"replica {index}")
    engine.expected_params = None
    engine.stats = {"num_running": 0, "num_waiting": 0, "pid": 1000 + index}
    return engine.start()


class DPSetup(FakeEnginesSetup):
    def __init__(self, replicas: list[FakeEngine], router: DPRouter) -> None:
        super().__init__(replicas, router)
        self.replicas = replicas


def make_router(replicas: list[FakeEngine], long_prompts: LongPrompts | None = None) -> DPRouter:
    queue = RouterQueue("tcp://127.0.0.1:0", 1 << 20)
    links = [EngineLink(e.role, e.address, engine_secret=ENGINE_SECRET, log_role="dp_router") for e in replicas]
    return DPRouter(queue, links, STEP_BUDGET, long_prompts)


async def serving(num_replicas: int, long_prompts: LongPrompts | None = None) -> DPSetup:
    replicas = [fake_replica(i) for i in range(num_replicas)]
    setup = DPSetup(replicas, make_router(replicas, long_prompts))
    await setup.router.connect(5.0)
    setup.serving = asyncio.create_task(setup.router.serve())
    return setup


@pytest.fixture
async def dp():
    """Two fake replicas behind a connected, serving router (a health check every 0.5 s, 1 s timeout)."""
    setup = await serving(2)
    try:
        yield setup
    finally:
        await setup.close()
