"""The real SmolLM2 (bfloat16) through the launched engine: pp=2 answers exactly as pp=1, token for token,
with a fixed split and with a boundary that moves per step (`parallel.shift_layers`)."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from tests.runtime.conftest import collect
from tests.runtime.harness import launched, real_sections

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "Explain recursion to a child in two sentences."}],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


async def run_chats(tmp_path, pp_size: int, shift_layers: int = 0) -> list[tuple[list[int], str, str | None]]:
    """The chats' greedy answers from an engine launched for them (`real_sections`), which then exits cleanly."""
    run_dir = tmp_path / f"pp{pp_size}-shift{shift_layers}"
    run_dir.mkdir()
    with launched(run_dir, real_sections(pp_size, shift_layers), ready_timeout_s=300) as engine:
        results = await answer_chats(engine.address, pp_size, shift_layers)
    assert engine.proc.returncode == 0
    return results


async def answer_chats(address: str, pp_size: int, shift_layers: int = 0) -> list[tuple[list[int], str, str | None]]:
    """The chats' greedy answers from the engine at `address`, which runs `real_sections(pp_size, shift_layers)`."""
    client = AsyncClient(address)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(collect(client, c, GREEDY) for c in CHATS)), 180)
        stats = await client.stats()
    finally:
        client.close()
    assert len(stats["stage_busy_s"]) == pp_size
    assert ("layer_balance" in stats) == bool(shift_layers)
    return results


async def test_real_model_pp2_equals_pp1(tmp_path, real_pp2_engine):
    pp1 = await run_chats(tmp_path, 1)
    pp2 = await answer_chats(real_pp2_engine[0].address, 2)  # exits cleanly at the session's end
    shifted = await run_chats(tmp_path, 2, shift_layers=4)
    for chat, one, two, three in zip(CHATS, pp1, pp2, shifted):
        tokens, text, reason = one
        assert tokens and text.strip(), (chat, one)
        assert reason in ("length", "stop")
        assert two == one, (chat, one, two)
        assert three == one, (chat, one, three)
