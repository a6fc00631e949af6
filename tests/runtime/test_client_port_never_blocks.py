"""The client port never waits on one message: a multi-megabyte chat prompt whose tokenizing takes
seconds (a hook makes it: `slow_tokenizer_launch`) is taken beside the port while 8 short requests
stream, and health is answered throughout (a prefill/decode router declares an engine dead when
health waits 1 s)."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncpp.client import AsyncClient
from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams
from tests.runtime.harness import launched, tiny_sections
from tests.runtime.slow_tokenizer_launch import SLOW_TOKENIZE_S

SHORT = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
HEALTH_BOUND_S = 0.5  # far below the hook's SLOW_TOKENIZE_S, far above a loaded machine's noise


async def test_health_and_streams_go_on_while_a_huge_prompt_is_tokenized(tmp_path, tiny_hf_dir):
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2))
    with launched(tmp_path, sections, module="tests.runtime.slow_tokenizer_launch") as engine:
        client = AsyncClient(engine.address)
        try:
            assert await client.health()
            latencies: list[float] = []
            done = asyncio.Event()

            async def poll_health() -> None:
                while not done.is_set():
                    t0 = time.monotonic()
                    assert await client.health(timeout_s=10.0)
                    latencies.append(time.monotonic() - t0)
                    await asyncio.sleep(0.02)

            async def short(i: int) -> int:
                return sum([len(d.token_ids) async for d in client.generate([5 + i, 6, 7, 8], SHORT)])

            async def huge() -> tuple[float, float]:
                t0 = time.monotonic()
                messages = [{"role": "user", "content": "word " * 600_000}]  # 3 MB
                with pytest.raises(InvalidRequestError, match="longer than max_model_len"):
                    async for _ in client.generate(messages, SHORT):
                        pass
                return t0, time.monotonic()

            poller = asyncio.create_task(poll_health())
            huge_task = asyncio.create_task(huge())
            await asyncio.sleep(0.2)  # the huge frame is in first: the short ones come while it is taken
            counts = await asyncio.gather(*(short(i) for i in range(8)))
            started, ended = await huge_task
            done.set()
            await poller
        finally:
            client.close()
    assert counts == [24] * 8
    assert ended - started >= SLOW_TOKENIZE_S  # the hook did hold that request up
    assert len(latencies) >= 10, latencies
    assert max(latencies) < HEALTH_BOUND_S, sorted(latencies)[-5:]
