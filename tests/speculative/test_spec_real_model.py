"""The real SmolLM2 (bfloat16, native GGUF weights) launched at pp=2 with the offload connector: greedy
answers with n-gram drafting are token for token those without it."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from tests.runtime.conftest import collect
from tests.runtime.harness import launched, real_sections
from tests.runtime.test_real_model_pp import CHATS

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PASSAGE = (
    "The river runs past the old mill, under the stone bridge and out across the fields, "
    "where the herons stand in the shallows and wait for the morning light."
)
REPEAT = [
    [{"role": "user", "content": f"Repeat this sentence exactly, twice: {PASSAGE}"}],
    [{"role": "user", "content": f"{PASSAGE}\n\nWrite that sentence again, word for word."}],
]
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


async def run_chats(tmp_path, speculative: bool) -> tuple[list, dict]:
    sections = real_sections(2)
    sections["kv_transfer"] = {"connector": "offload", "store": "shm", "store_size_mb": 64}
    if speculative:
        sections["speculative"] = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    run_dir = tmp_path / ("spec" if speculative else "plain")
    run_dir.mkdir()
    with launched(run_dir, sections, ready_timeout_s=300) as engine:
        client = AsyncClient(engine.address)
        try:
            chats = REPEAT + CHATS
            results = await asyncio.wait_for(asyncio.gather(*(collect(client, c, GREEDY) for c in chats)), 300)
            stats = await client.stats()
        finally:
            client.close()
    assert engine.proc.returncode == 0
    return results, stats


async def test_real_model_pp2_offload_drafting_equals_plain(tmp_path):
    plain, _ = await run_chats(tmp_path, speculative=False)
    spec, stats = await run_chats(tmp_path, speculative=True)
    assert [r[0] for r in spec] == [r[0] for r in plain]
    assert [r[1] for r in spec] == [r[1] for r in plain]
    assert stats["spec_decode_num_accepted_tokens"] > 20  # the repeated passage was drafted
    assert stats["kv_blocks_saved"] > 0
    assert "herons" in plain[0][1]
