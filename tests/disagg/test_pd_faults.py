"""Faults between two launched engines moving KV with the real `pd` connector (each engine and each
stage its own process): a producer stopped (SIGSTOP) with params out costs only the requests that
pull from it, and an abort between the prefill and the decode (after_prefill handover) frees the
producer's blocks at once, not after `pull_timeout_s`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from asyncpp.client import AsyncClient, RequestFailedError
from asyncpp.disagg.link import EngineLink
from asyncpp.disagg.router import PDRouter
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.queues import RouterQueue
from tests.conftest import tiny_prompts
from tests.disagg.conftest import until
from tests.runtime.conftest import is_idle
from tests.runtime.harness import LaunchedEngine, launched, tiny_sections
from tests.transport.test_nixl_stopped_peer import stop

pytest.importorskip("nixl_cu12")

LOAD_TIMEOUT_S = 3.0
PULL_TIMEOUT_S = 60.0  # far beyond every wait below: nothing here is freed by the producer's timeout
PREFILL = {"max_tokens": 1, "temperature": 0.0}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
ENGINE_SECRET = "test-pd-engine-secret"  # both engines', and what the test presents as their deployment


@contextlib.contextmanager
def pd_engines(tmp_path, model_dir) -> Iterator[tuple[LaunchedEngine, LaunchedEngine]]:
    def sections(role: str, engine_id: str) -> dict:
        kv = {"connector": "pd", "kv_role": role, "engine_id": engine_id,
              "load_timeout_s": LOAD_TIMEOUT_S, "pull_timeout_s": PULL_TIMEOUT_S}  # fmt: skip
        return tiny_sections(model_dir, 1, kv_transfer=kv, server={"engine_secret": ENGINE_SECRET})

    (tmp_path / "prefill").mkdir()
    (tmp_path / "decode").mkdir()
    with launched(tmp_path / "prefill", sections("producer", "prefill-0")) as prefill:
        with launched(tmp_path / "decode", sections("consumer", "decode-0")) as decode:
            yield prefill, decode


async def handed_out(client: AsyncClient, prompt) -> dict:
    """The producer's params for `prompt` (it holds the prompt's blocks for them)."""
    deltas = [d async for d in client.generate(prompt, PREFILL, kv_transfer_params={"do_remote_decode": True})]
    assert deltas[-1].kv_transfer_params is not None, deltas[-1]
    return deltas[-1].kv_transfer_params


async def chain(client: AsyncClient, prompts, until_done: asyncio.Event, arrivals: list[float]) -> int:
    """Plain requests on the decode engine, one after another until `until_done`: the time of every
    delta. Returns how many finished."""
    num_done = 0
    while not until_done.is_set():
        async for _ in client.generate(prompts[num_done % len(prompts)], GREEDY):
            arrivals.append(time.monotonic())
        num_done += 1
    return num_done


async def test_a_stopped_producer_costs_only_the_requests_pulling_from_it(tmp_path, tiny_hf_dir):
    prompts = tiny_prompts(300, 6)
    with pd_engines(tmp_path, tiny_hf_dir) as (prefill, decode):
        producer = AsyncClient(prefill.address, secret=ENGINE_SECRET, role="engine")
        consumer = AsyncClient(decode.address, secret=ENGINE_SECRET, role="engine")
        try:
            await consumer.add_remote_engine(await producer.kv_handshake())
            # One pull from the producer while it runs (its connection is up), then params for two
            # more, and the producer is stopped, engine and stages.
            params = await handed_out(producer, prompts[0])
            [_ async for _ in consumer.generate(prompts[0], GREEDY, kv_transfer_params=params)]
            stuck = [await handed_out(producer, p) for p in prompts[1:3]]
            stats = await producer.stats()
            assert stats["num_held_for_transfer"] == 2
            pids = [stats["pid"], *stats["stage_pids"]]
            for pid in pids:
                stop(pid)
            try:
                done = asyncio.Event()
                arrivals: list[list[float]] = [[], []]
                chains = [asyncio.create_task(chain(consumer, prompts[3:], done, a)) for a in arrivals]
                await until(lambda: all(len(a) > 5 for a in arrivals), 30, "plain requests decoding")

                async def pull(prompt, kv) -> tuple[float, str]:
                    t0 = time.monotonic()
                    with pytest.raises(RequestFailedError) as info:
                        [_ async for _ in consumer.generate(prompt, GREEDY, kv_transfer_params=kv)]
                    return time.monotonic() - t0, str(info.value)

                t_stuck = time.monotonic()
                failures = await asyncio.gather(*(pull(p, kv) for p, kv in zip(prompts[1:3], stuck)))
                t_failed = time.monotonic()
                await asyncio.sleep(0.5)  # the plain requests go on after the failures too
                done.set()
                num_finished = await asyncio.gather(*chains)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            # The plain requests ran all along, never held up by the stuck pulls: no gap between two
            # deltas of a chain near the pulls' timeout (a step of the tiny model takes milliseconds).
            assert sum(num_finished) >= 2
            for times in arrivals:
                assert times[0] < t_stuck and times[-1] > t_failed
                gaps = [b - a for a, b in zip(times, times[1:])]
                assert max(gaps) < 1.0, f"a {max(gaps):.2f} s gap between two deltas"
            for seconds, error in failures:  # within their timeout (and at it: the producer never answered)
                assert "within load_timeout_s" in error, error
                assert LOAD_TIMEOUT_S - 0.5 < seconds < LOAD_TIMEOUT_S + 2.5, (seconds, error)
            # After SIGCONT the producer hears that nobody reads its blocks: all free, long before
            # its pull_timeout_s; the decode engine holds nothing either.
            await until_stats(producer, lambda s: is_idle(s) and s["num_held_for_transfer"] == 0, 10, "producer idle")
            await until_stats(consumer, is_idle, 10, "consumer idle")
            assert (await producer.stats())["num_timed_out_transfers"] == 0
            # Both serve again.
            params = await handed_out(producer, prompts[4])
            assert len([_ async for _ in consumer.generate(prompts[4], GREEDY, kv_transfer_params=params)]) > 0
        finally:
            producer.close()
            consumer.close()


async def test_an_abort_after_the_prefill_handed_out_frees_its_blocks_at_once(tmp_path, tiny_hf_dir):
    """after_prefill: the client aborts as the prefill's last delta (its params) reaches the router,
    before the decode request is sent: the producer frees the prompt's blocks at once."""
    prompt = tiny_prompts(300, 1)[0]
    with pd_engines(tmp_path, tiny_hf_dir) as (prefill, decode):
        queue = RouterQueue("tcp://127.0.0.1:0", 1 << 20)
        links = [EngineLink(role, engine.address, engine_secret=ENGINE_SECRET) for role, engine in (("prefill", prefill), ("decode", decode))]
        router = PDRouter(queue, *links, "after_prefill")
        await router.connect(30.0)
        serving = asyncio.create_task(router.serve())
        client = AsyncClient(router.address)
        real_generate = router.prefill.client.generate

        async def generate_then_abort(*args, **kwargs):  # the hook: abort as the params come
            async for delta in real_generate(*args, **kwargs):
                if delta.finished and delta.kv_transfer_params is not None:
                    [(peer, request_id)] = router.requests
                    router.abort(peer, request_id)
                yield delta

        router.prefill.client.generate = generate_then_abort
        try:
            stream = client.generate(prompt, GREEDY, "r")
            first = await anext(stream)  # the prefill's token
            assert first.token_ids and not first.finished
            await until(lambda: router.counters.num_aborted == 1, 10, "abort")
            t0 = time.monotonic()
            producer = router.prefill.client
            await until_stats(producer, lambda s: s["num_held_for_transfer"] == 0 and is_idle(s), 10, "blocks freed")
            assert time.monotonic() - t0 < 10 < PULL_TIMEOUT_S
            stats = await client.stats()
            assert stats["prefill"]["num_timed_out_transfers"] == 0  # released, not timed out
            assert stats["pd_num_released_after_prefill"] == 1 and stats["pd_num_handovers"] == 0
            # The decode engine released them unpulled, or pulled them if its step admitted the request
            # before the abort came.
            assert stats["decode"]["pd_num_released_unpulled"] + stats["decode"]["pd_num_pulls"] == 1
            await until_stats(router.decode.client, is_idle, 10, "decode engine idle")
            await stream.aclose()
        finally:
            client.close()
            await router.drain_and_stop(0.0)
            await serving
            await router.close()


async def until_stats(client: AsyncClient, is_done, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_done(stats := await client.stats()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s: {stats}")
        await asyncio.sleep(0.05)
