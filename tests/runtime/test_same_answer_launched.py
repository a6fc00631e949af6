"""The default deployment's pipeline (the engine of two stages its long prompts go to) answers the
same whatever its split and threads do, step by step.

`moving_split_launch` makes the boundary jump around the shift window and the lent
threads come and go on every step, and holds the last stage back on prompt steps
so the first stage runs the next prompt chunk ahead of it (what a busy core did
by chance, #51). Greedy tokens must equal the fixed split's, one prompt at a time
(a prompt's chunks in flight together) and all at once (shared prefix blocks);
seeded sampling's, alone and among the greedy requests.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from asyncpp.config import config_from_dict
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import default_pipeline_sections
from tests.runtime.conftest import collect
from tests.runtime.harness import launched

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

CHATS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
    [{"role": "user", "content": "Tell me about the sea"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "Explain recursion to a child in two sentences, then give an example in Python."}],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def fixed_split() -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of every chat, and seeded ones of the first two, from a fixed split in process."""
    engine = Engine(config_from_dict(default_pipeline_sections()).replace(parallel={"shift_layers": 0}))
    greedy = [r.token_ids for r in engine.generate(CHATS, GREEDY)]
    return greedy, [r.token_ids for r in engine.generate(CHATS[:2], SEEDED)]


async def test_a_split_and_threads_that_move_every_step_give_the_fixed_split_s_tokens(tmp_path, fixed_split):
    sections = default_pipeline_sections()
    sections["server"].update(grace_period_s=2.0)
    with launched(tmp_path, sections, module="tests.runtime.moving_split_launch", ready_timeout_s=300) as engine:
        client = AsyncClient(engine.address)
        try:
            alone = [(await collect(client, chat, GREEDY))[0] for chat in CHATS]
            together = await asyncio.gather(*(collect(client, chat, GREEDY) for chat in CHATS))
            seeded_alone = [(await collect(client, chat, SEEDED))[0] for chat in CHATS[:2]]
            crowd = [(chat, SEEDED if i < 2 else GREEDY) for i, chat in enumerate(CHATS[:2] + CHATS)]
            seeded_crowded = await asyncio.gather(*(collect(client, chat, params) for chat, params in crowd))
            stats = await client.stats()
        finally:
            client.close()
    greedy, seeded = fixed_split
    assert alone == greedy
    assert [tokens for tokens, _, _ in together] == greedy
    assert seeded_alone == seeded and seeded != greedy[:2]
    assert [tokens for tokens, _, _ in seeded_crowded] == seeded + greedy
    # The hooks did vary what they should: many splits, steps with and without lent threads.
    assert len(stats["layer_balance"]["bounds_counts"]) >= 4, stats["layer_balance"]
    assert 0 < stats["num_lent_steps"] < stats["num_steps"]
