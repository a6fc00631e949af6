"""A request whose client stops listening is aborted in the engine and its KV blocks are freed.

Three ways to stop listening: break out of `async for`, cancel the task, or
disconnect without a word. A long request would also end on its own within
a second or two, so each test checks the engine logged `request_aborted` (not
`request_finished`) for it, then waits (with a deadline) until the engine is
idle again: nothing running or waiting and every KV block free.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.runtime.conftest import collect, is_idle, log_events, poll_until, wait_for_event

# max_model_len is 256: a 33-token prompt leaves room for 200 tokens, far more than the test waits for.
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
PROMPT = tiny_prompts(320, 4)[3]
IDLE_TIMEOUT_S = 5.0


@pytest.fixture
async def client(shared_pp2_engine):
    c = AsyncClient(shared_pp2_engine.address)
    await poll_until(c.stats, is_idle, IDLE_TIMEOUT_S)  # a clean start, whatever ran before
    yield c
    c.close()


def new_id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


async def assert_aborted_and_freed(client: AsyncClient, log_file, request_id: str) -> dict:
    events = await wait_for_event(log_file, "request_aborted", IDLE_TIMEOUT_S, request_id=request_id)
    assert "request_finished" not in events, events
    stats = await poll_until(client.stats, is_idle, IDLE_TIMEOUT_S)
    assert not stats["is_dead"]
    assert client._streams == {}
    return stats


async def test_breaking_out_of_the_stream_aborts(client, shared_pp2_engine):
    request_id = new_id("break")
    num_deltas = 0
    async for delta in client.generate(PROMPT, LONG, request_id=request_id):
        num_deltas += 1
        assert not delta.finished
        if num_deltas == 2:
            stats = await client.stats()
            assert stats["num_running"] == 1 and stats["num_free_kv_blocks"] < stats["num_kv_blocks"]
            break
    await assert_aborted_and_freed(client, shared_pp2_engine.log_file, request_id)


async def test_cancelling_the_task_aborts(client, shared_pp2_engine):
    request_id = new_id("cancel")
    num_deltas = 0
    got_two = asyncio.Event()

    async def consume():
        nonlocal num_deltas
        async for _ in client.generate(PROMPT, LONG, request_id=request_id):
            num_deltas += 1
            if num_deltas == 2:
                got_two.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_two.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert num_deltas < LONG.max_tokens
    await assert_aborted_and_freed(client, shared_pp2_engine.log_file, request_id)


async def test_cancelling_a_just_submitted_request_aborts(client, shared_pp2_engine):
    request_id = new_id("early")
    task = asyncio.create_task(collect_with_id(client, PROMPT, request_id))
    await wait_for_event(shared_pp2_engine.log_file, "request_received", 5, request_id=request_id)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_aborted_and_freed(client, shared_pp2_engine.log_file, request_id)


async def collect_with_id(client: AsyncClient, prompt, request_id: str) -> list[int]:
    tokens = []
    async for delta in client.generate(prompt, LONG, request_id=request_id):
        tokens += delta.token_ids
    return tokens


async def test_abrupt_disconnect_aborts_while_others_continue(client, shared_pp2_engine):
    log_file = shared_pp2_engine.log_file
    other_prompt = tiny_prompts(320, 2)[1]
    expected = await collect(client, other_prompt, LONG)  # the other client's request, run alone
    assert len(expected[0]) == LONG.max_tokens

    leaver = AsyncClient(shared_pp2_engine.address)
    request_id = new_id("leaver")
    got_two = asyncio.Event()

    async def consume():
        num_deltas = 0
        async for _ in leaver.generate(PROMPT, LONG, request_id=request_id):
            num_deltas += 1
            if num_deltas == 2:
                got_two.set()

    leaving = asyncio.create_task(consume())
    await asyncio.wait_for(got_two.wait(), timeout=10)
    staying = asyncio.create_task(collect(client, other_prompt, LONG))
    await poll_until(client.stats, lambda s: s["num_running"] == 2, timeout_s=10)
    # Vanish without an AbortRequest: stop reading and close the socket.
    leaver._reader.cancel()
    leaver._queue.close()
    leaving.cancel()  # its consumer would wait forever; its abort cannot go out on the closed socket
    with pytest.raises(asyncio.CancelledError):
        await leaving

    events = await wait_for_event(log_file, "request_aborted", IDLE_TIMEOUT_S, request_id=request_id)
    assert "request_finished" not in events, events
    assert "client_gone" in log_events(log_file)
    assert await asyncio.wait_for(staying, timeout=30) == expected
    stats = await poll_until(client.stats, is_idle, IDLE_TIMEOUT_S)
    assert not stats["is_dead"]
    assert await client.health()
