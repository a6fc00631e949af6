"""A stage of either engine of a prefill/decode pair dies and is restarted in place
(`asyncpp.runtime.recovery`): requests go on with the tokens of an undisturbed run, and params
handed out by the producer's old stages are never read from its new ones.

Two launched pp = 2 engines on the tiny model move KV with the real `pd` connector, behind a
router in this process (early handover, as deployed).
* The decode engine loses stage 1 while every request decodes: their pulled KV is gone, so each
  computes its prompt there (`pd_num_computed_here`), and all finish exactly.
* The prefill engine loses stage 0: its KV generation goes up, the router gives the decode engine
  its new handshake, requests through the router answer exactly again, and params handed out before
  the restart are refused by name (their blocks are gone) instead of being read from new memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator

import pytest

from asyncpp.client import AsyncClient
from asyncpp.errors import InvalidRequestError
from asyncpp.disagg.link import EngineLink
from asyncpp.disagg.router import PDRouter
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.queues import RouterQueue
from tests.conftest import tiny_prompts
from tests.disagg.conftest import until
from tests.runtime.harness import launched, tiny_sections

pytest.importorskip("nixl_cu12")

LIVENESS_S = 60.0  # a bound for a busy 2-core machine, not a speed
ENGINE_SECRET = "test-pd-restart-secret"
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)


@contextlib.asynccontextmanager
async def pd_pair(tmp_path, model_dir) -> AsyncIterator[tuple[PDRouter, AsyncClient, AsyncClient, AsyncClient]]:
    """Both engines launched (pp = 2) and a serving router: (router, its client, prefill's, decode's)."""

    def sections(role: str, engine_id: str) -> dict:
        kv = {"connector": "pd", "kv_role": role, "engine_id": engine_id, "load_timeout_s": 20.0, "pull_timeout_s": 60.0}
        return tiny_sections(model_dir, 2, (), kv_transfer=kv, server={"engine_secret": ENGINE_SECRET})

    for role in ("prefill", "decode"):
        (tmp_path / role).mkdir()
    with launched(tmp_path / "prefill", sections("producer", "prefill-0")) as prefill:
        with launched(tmp_path / "decode", sections("consumer", "decode-0")) as decode:
            links = [EngineLink(role, e.address, engine_secret=ENGINE_SECRET) for role, e in (("prefill", prefill), ("decode", decode))]
            router = PDRouter(RouterQueue("tcp://127.0.0.1:0", 1 << 20), *links)
            await router.connect(LIVENESS_S)
            serving = asyncio.create_task(router.serve())
            clients = [AsyncClient(router.address)] + [
                AsyncClient(e.address, secret=ENGINE_SECRET, role="engine") for e in (prefill, decode)
            ]
            try:
                yield router, *clients
            finally:
                await router.drain_and_stop(0.0)
                await serving
                await router.close()
                for client in clients:
                    client.close()


async def serve(client: AsyncClient, prompts, disturb=None) -> list[list[int]]:
    """Every prompt at once (greedy and seeded in turn); `disturb()` once every one decodes."""
    num_decoding = [0]
    all_decode = asyncio.Event()

    async def one(i: int, prompt) -> list[int]:
        tokens: list[int] = []
        async for delta in client.generate(prompt, SEEDED if i % 2 else GREEDY):
            tokens += delta.token_ids
            if len(tokens) >= 4 and len(tokens) - len(delta.token_ids) < 4:
                num_decoding[0] += 1
                if num_decoding[0] == len(prompts):
                    all_decode.set()
        return tokens

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    if disturb is not None:
        await asyncio.wait_for(all_decode.wait(), LIVENESS_S)
        await disturb()
    return await asyncio.wait_for(asyncio.gather(*tasks), LIVENESS_S)


async def restarted(engine: AsyncClient, stage: int, count: int) -> dict:
    """Kill one stage of the engine; its stats once it has restarted `count` stages in all."""
    os.kill((await engine.stats())["stage_pids"][stage], signal.SIGKILL)
    stats: dict = {}

    async def check() -> bool:
        stats.update(await engine.stats())
        return stats["stage_restarts"] == count and stats["num_running"] == 0

    deadline = asyncio.get_running_loop().time() + LIVENESS_S
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "the stage was not restarted"
        await asyncio.sleep(0.1)
    return stats


async def test_either_engine_losing_a_stage_goes_on_exactly(tmp_path, tiny_hf_dir):
    prompts = [p * 2 for p in tiny_prompts(300, 4)]
    async with pd_pair(tmp_path, tiny_hf_dir) as (router, client, prefill, decode):
        expected = await serve(client, prompts)
        assert all(len(tokens) == 32 for tokens in expected)

        # The decode engine loses a stage while every request decodes.
        async def kill_decode_stage() -> None:
            os.kill((await decode.stats())["stage_pids"][1], signal.SIGKILL)

        assert await serve(client, prompts, kill_decode_stage) == expected
        stats = await decode.stats()
        assert stats["stage_restarts"] == 1 and stats["pd_num_computed_here"] == len(prompts)
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and not stats["is_dead"]

        # The prefill engine loses a stage with params out (its blocks held for them).
        held = [d async for d in prefill.generate(prompts[0], {"max_tokens": 1}, kv_transfer_params={"do_remote_decode": True})]
        old_params = held[-1].kv_transfer_params
        assert old_params["generation"] == 0
        stats = await restarted(prefill, 0, 1)
        assert stats["pd_generation"] == 1 and stats["num_held_for_transfer"] == 0
        await until(lambda: router.prefill.kv_generation == 1, LIVENESS_S, "the router gave the new handshake")
        with pytest.raises(InvalidRequestError, match="generation 0 .* the blocks are gone"):
            [_ async for _ in decode.generate(prompts[0], GREEDY, kv_transfer_params=old_params)]
        assert await serve(client, prompts) == expected
        assert (await prefill.stats())["pd_num_handed_out"] > len(prompts)
        stats = await decode.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["pd_num_pulls"] >= 2 * len(prompts)
