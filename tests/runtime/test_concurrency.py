"""200 concurrent requests over ONE client on pp=2: each output equals the same request run alone in-process."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config
from tests.runtime.conftest import collect, is_idle, poll_until

NUM_REQUESTS = 200
VOCAB = 320


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 80))] for _ in range(NUM_REQUESTS)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0) for _ in range(NUM_REQUESTS)]
    # Both ends of both ranges are in the mix.
    prompts[0], prompts[1] = prompts[0][:3], (prompts[1] * 80)[:80]
    params[0], params[1] = SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.0)
    return prompts, params


@pytest.fixture(scope="module")
def singles(tiny_hf_dir, workload):
    """Each request run alone (one at a time) in the in-process engine."""
    engine = Engine(tiny_config(tiny_hf_dir))
    prompts, params = workload
    return [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]


async def test_200_concurrent_requests_over_one_client(shared_pp2_engine, workload, singles):
    prompts, params = workload
    client = AsyncClient(shared_pp2_engine.address)
    try:
        t0 = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(client, p, sp) for p, sp in zip(prompts, params))), timeout=120
        )
        elapsed = time.monotonic() - t0
        stats = await poll_until(client.stats, is_idle, timeout_s=5)
    finally:
        client.close()
    num_tokens = sum(len(r[0]) for r in results)
    print(f"\n{NUM_REQUESTS} concurrent requests, {num_tokens} tokens, pp=2: {elapsed:.2f} s")
    mismatches = [
        (i, r[0], s.token_ids)
        for i, (r, s) in enumerate(zip(results, singles))
        if (r[0], r[1], r[2]) != (s.token_ids, s.text, s.finish_reason)
    ]
    assert not mismatches, f"{len(mismatches)} of {NUM_REQUESTS} differ, first: {mismatches[0]}"
    assert all(r[2] in ("length", "stop") for r in results)
    assert all(0 < len(r[0]) <= sp.max_tokens for r, sp in zip(results, params))
    assert stats["num_steps"] > 0 and not stats["is_dead"]
    assert client._streams == {}  # every stream was cleaned up
