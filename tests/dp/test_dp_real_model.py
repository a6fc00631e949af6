"""The real SmolLM2 (bfloat16) as the default deployment's shape, two one-stage replicas and a two-stage
long-prompt replica behind the router: every short chat answered on each replica, every long one on the
long-prompt replica, token for token as the two-stage engine answers it."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from asyncpp.dp.placement import prompt_tokens
from tests.runtime.conftest import collect
from tests.runtime.harness import launched, real_sections
from tests.runtime.test_real_model_pp import CHATS, GREEDY, answer_chats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
]


async def test_real_model_replicas_and_the_long_prompt_replica_answer_as_the_pipeline(tmp_path, real_pp2_engine):
    expected = await answer_chats(real_pp2_engine[0].address, 2)
    sections = real_sections(1)
    long_tokens = 10  # the router's estimate of CHATS: 7, 7, 11, 11 tokens
    sections["parallel"] |= {"dp_size": 2, "long_prompt_pp_size": 2, "long_prompt_tokens": long_tokens}
    is_long = [prompt_tokens(chat) >= long_tokens for chat in CHATS]
    assert 0 < sum(is_long) < len(CHATS)
    with launched(tmp_path, sections, ready_timeout_s=300) as dp:
        client = AsyncClient(dp.address)
        try:
            # Each chat twice at once, one chat after another: the second copy of a short one goes to
            # the replica without a prompt queued, so each short chat runs on both replicas.
            results = []
            for chat in CHATS:
                results += await asyncio.wait_for(asyncio.gather(*(collect(client, chat, GREEDY) for _ in range(2))), 180)
            stats = await client.stats()
        finally:
            client.close()
    assert dp.proc.returncode == 0
    num_short = is_long.count(False)
    assert stats["dp_num_routed"] == [num_short, num_short, 2 * sum(is_long)]
    for i, chat in enumerate(CHATS):
        assert results[2 * i] == results[2 * i + 1] == expected[i], (chat, results[2 * i], results[2 * i + 1], expected[i])
