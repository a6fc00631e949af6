"""The real SmolLM2 (bfloat16) as two one-stage replicas behind the router: every chat answered on each
replica, token for token as the two-stage engine answers it."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from tests.runtime.conftest import collect
from tests.runtime.harness import launched, real_sections
from tests.runtime.test_real_model_pp import CHATS, GREEDY, answer_chats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
]


async def test_real_model_replicas_each_answer_as_the_pipeline(tmp_path, real_pp2_engine):
    expected = await answer_chats(real_pp2_engine[0].address, 2)
    sections = real_sections(1)
    sections["parallel"]["dp_size"] = 2
    with launched(tmp_path, sections, ready_timeout_s=300) as dp:
        client = AsyncClient(dp.address)
        try:
            # Each chat twice at once, one chat after another: the second copy goes to the replica
            # without a prompt queued, so each chat runs on both replicas.
            results = []
            for chat in CHATS:
                results += await asyncio.wait_for(asyncio.gather(*(collect(client, chat, GREEDY) for _ in range(2))), 180)
            stats = await client.stats()
        finally:
            client.close()
    assert dp.proc.returncode == 0
    assert stats["dp_num_routed"] == [len(CHATS), len(CHATS)]
    for i, chat in enumerate(CHATS):
        assert results[2 * i] == results[2 * i + 1] == expected[i], (chat, results[2 * i], results[2 * i + 1], expected[i])
