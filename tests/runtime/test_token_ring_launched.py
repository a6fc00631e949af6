"""Sampled tokens through the token ring (`parallel.token_handoff = "ring"`, shared memory on CPU):
the same greedy tokens as the in-process engine, with steps that must go the host path (logprobs)
mixed in. (The CUDA ring: tests/cuda/test_cuda_path.py, pp = 2 and 3.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect, collect_all
from tests.runtime.harness import launched, tiny_sections

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(321, 8)


@pytest.fixture(scope="module")
def in_process(tiny_hf_dir, prompts):
    return [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]


def taken(log_file) -> dict:
    """The first stage's count of steps whose tokens came on the device and on the host."""
    for line in log_file.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "sampled_tokens_taken":
            return {"on_device": event["on_device"], "on_host": event["on_host"]}
    raise AssertionError("the first stage logged no sampled_tokens_taken")


async def test_ring_equals_in_process_and_mixes_with_host_steps(tmp_path, tiny_hf_dir, prompts, in_process):
    """All greedy: every step's tokens take the ring, its slots reused many times over. Then requests
    with logprobs among greedy ones: their steps go the host path, the others' the ring."""
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), parallel={"token_handoff": "ring"})
    with launched(tmp_path, sections) as engine:
        results, _ = await collect_all(engine.address, prompts, GREEDY)
        client = AsyncClient(engine.address)
        try:
            params = [WITH_LOGPROBS if i % 3 == 0 else GREEDY for i in range(len(prompts))]
            mixed = await asyncio.gather(*(collect(client, p, sp) for p, sp in zip(prompts, params)))
        finally:
            client.close()
    assert [r[0] for r in results] == in_process
    assert [r[0] for r in mixed] == in_process
    counts = taken(engine.log_file)
    assert counts["on_host"] > 0 and counts["on_device"] > 4 * 8  # its 4 slots reused 8 times over
