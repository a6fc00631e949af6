"""The data-parallel router against fake replicas: where each request goes, what clients see."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncpp.client import AsyncClient, RequestFailedError
from asyncpp.dp.router import DPRouter
from asyncpp.errors import EngineDeadError, InvalidRequestError
from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.wire.client_msgs import ErrorReply, GenerateRequest, RequestDeltas
from asyncpp.wire.queues import DealerQueue
from tests.disagg.conftest import until
from tests.disagg.fakes import decode_deltas
from tests.dp.conftest import DPSetup, make_router, serving

PARAMS = {"max_tokens": 3, "temperature": 0.0, "seed": 5, "stop": ["c"], "logprobs": 2}


async def collect(client: AsyncClient, prompt="hello", params=PARAMS, request_id: str | None = None, kv=None) -> list:
    return [delta async for delta in client.generate(prompt, params, request_id, kv)]


def held(setup: DPSetup, index: int) -> list[str]:
    """Ids of the requests replica `index` got."""
    return [msg.request_id for msg in setup.replicas[index].received]


async def test_a_request_goes_whole_to_one_replica_and_comes_back_unchanged(dp: DPSetup):
    kv = {"opaque": [1, 2]}
    dp.replicas[0].expected_params = kv
    assert await collect(dp.client(), request_id="r1", kv=kv) == decode_deltas("r1")
    [msg] = dp.replicas[0].received
    assert dp.replicas[1].received == []
    assert msg.request_id.startswith("r1.dp") and msg.prompt == "hello" and msg.sampling_params == PARAMS
    assert msg.kv_transfer_params == kv  # verbatim: a lone engine would get it too
    assert dp.router.requests == {} and dp.router.num_unfinished == [0, 0]


async def test_equal_loads_alternate_and_a_busy_replica_is_passed_over(dp: DPSetup):
    client = dp.client()
    for n in range(4):  # one at a time: both idle each time, so they take turns
        await collect(client, request_id=f"seq{n}")
    assert [len(held(dp, i)) for i in (0, 1)] == [2, 2]
    dp.replicas[0].gate.clear()  # replica 0 holds what it gets
    a = asyncio.create_task(collect(client, request_id="a"))
    await until(lambda: len(held(dp, 0)) == 3, what="a on replica 0")
    for n in range(3):  # replica 1 idle, replica 0 busy: every one goes to replica 1
        await collect(client, request_id=f"b{n}")
    assert len(held(dp, 0)) == 3 and len(held(dp, 1)) == 5
    assert dp.router.num_unfinished == [1, 0]
    dp.replicas[0].gate.set()
    assert await a == decode_deltas("a")
    assert dp.router.num_unfinished == [0, 0] and dp.router.num_routed == [3, 5]


async def test_many_at_once_spread_evenly():
    setup = await serving(3)
    try:
        for replica in setup.replicas:
            replica.gate.clear()
        client = setup.client()
        tasks = [asyncio.create_task(collect(client, request_id=f"r{n}")) for n in range(9)]
        await until(lambda: sum(len(r.received) for r in setup.replicas) == 9, what="all nine routed")
        assert [len(r.received) for r in setup.replicas] == [3, 3, 3]
        for replica in setup.replicas:
            replica.gate.set()
        assert await asyncio.gather(*tasks) == [decode_deltas(f"r{n}") for n in range(9)]
    finally:
        await setup.close()


async def test_a_long_prompt_goes_to_the_replica_only_decoding_not_the_one_prefilling(dp: DPSetup):
    client = dp.client()
    loads = dp.router.loads
    dp.replicas[0].gate.clear()  # replica 0 holds its requests after their first delta: decoding
    dp.replicas[1].first_gate.clear()  # replica 1 holds them before it: prefilling
    long_prompt = list(range(3, 1003))
    a = asyncio.create_task(collect(client, request_id="a"))
    await until(lambda: loads.num_decoding == [1, 0], what="a decoding on replica 0")
    b = asyncio.create_task(collect(client, long_prompt, request_id="b"))  # 1 / 128 steps against 1 / 127
    await until(lambda: loads.queued_tokens == [0, 1000], what="b queued on replica 1")
    c = asyncio.create_task(collect(client, request_id="c"))  # 1 / 127 against 1001 / 128
    await until(lambda: loads.num_decoding == [2, 0], what="c decoding on replica 0")
    assert dp.router.num_unfinished == [2, 1]
    d = asyncio.create_task(collect(client, long_prompt, request_id="d"))  # 1000 / 126 against 2000 / 128
    await until(lambda: len(held(dp, 0)) == 3, what="d on replica 0")
    assert held(dp, 1) == [held(dp, 1)[0]] and dp.router.num_unfinished == [3, 1]
    stats = await client.stats()
    assert stats["dp_queued_prompt_tokens"] == [0, 1000] and stats["dp_num_decoding"] == [3, 0]
    dp.replicas[0].gate.set()
    dp.replicas[1].first_gate.set()
    assert await asyncio.gather(a, b, c, d) == [decode_deltas(rid) for rid in "abcd"]
    assert loads.queued_tokens == [0, 0] and loads.num_queued == [0, 0] and loads.num_decoding == [0, 0]


async def test_a_request_ended_before_its_first_delta_leaves_no_queued_tokens(dp: DPSetup):
    dp.replicas[0].first_gate.clear()
    client = dp.client()
    task = asyncio.create_task(collect(client, list(range(3, 503)), request_id="gone"))
    await until(lambda: dp.router.loads.queued_tokens == [500, 0], what="queued on replica 0")
    await client.abort("gone")
    await until(lambda: dp.router.requests == {}, what="the abort")
    assert dp.router.loads.queued_tokens == [0, 0] and dp.router.num_unfinished == [0, 0]
    assert dp.router.counters.num_aborted == 1
    dp.replicas[0].first_gate.set()
    task.cancel()


@pytest.mark.parametrize("prompt", [12345, None, {"text": "hi"}, [1.5, "x"]])
async def test_a_prompt_of_the_wrong_type_fails_alone_and_reaches_no_replica(dp: DPSetup, prompt):
    client = dp.client()
    dp.replicas[0].gate.clear()
    held_request = asyncio.create_task(collect(client, request_id="same"))
    await until(lambda: dp.router.num_unfinished == [1, 0], what="a live request")
    with pytest.raises(InvalidRequestError, match="prompt"):  # the router cannot read it: under its id
        await asyncio.wait_for(collect(client, prompt, request_id="odd"), 5)
    # A bad frame under a live request's id names no request: that one runs on.
    await client._put(GenerateRequest("same", prompt, PARAMS))
    await until(lambda: len(client.unrouted_errors) == 1, what="the unrouted error")
    assert client.unrouted_errors[0].request_id is None and client.unrouted_errors[0].kind == "bad_frame"
    dp.replicas[0].gate.set()
    assert await held_request == decode_deltas("same")
    assert [len(held(dp, i)) for i in (0, 1)] == [1, 0] and dp.router.loads.queued_tokens == [0, 0]


@pytest.mark.parametrize("error", [
    ErrorReply(None, "prompt: the fake refuses it", "invalid_request", "prompt"),
    ErrorReply(None, "the prompt is too long", "too_long", None),
])  # fmt: skip
async def test_replica_errors_reach_the_client_with_their_kind(dp: DPSetup, error):
    dp.replicas[0].error = error
    client = dp.client()
    if error.kind == "invalid_request":
        with pytest.raises(InvalidRequestError, match="prompt: the fake refuses it"):
            await collect(client, "replica 0 error")
    else:
        with pytest.raises(RequestFailedError, match="too_long: the prompt is too long"):
            await collect(client, "replica 0 error")
    assert dp.router.requests == {} and dp.router.counters.num_failed == 1
    assert await collect(client, request_id="next") == decode_deltas("next")  # the next one is served


async def test_a_replica_refusing_the_clients_kv_transfer_params_is_the_clients_error(dp: DPSetup):
    with pytest.raises(InvalidRequestError, match="kv_transfer_params: expected None") as info:
        await collect(dp.client(), kv={"bad": 1})
    assert info.value.field == "kv_transfer_params"


async def test_abort_reaches_the_replica_that_holds_the_request(dp: DPSetup):
    dp.replicas[0].gate.clear()
    client = dp.client()
    stream = client.generate("hello", PARAMS, "r")
    await anext(stream)  # the replica's first delta: it holds the request now
    await stream.aclose()  # sends the abort
    [engine_id] = held(dp, 0)
    await until(lambda: dp.replicas[0].aborted == [engine_id], what="abort at replica 0")
    assert dp.replicas[1].aborted == [] and dp.router.num_unfinished == [0, 0]
    assert dp.router.counters.num_aborted == 1


async def test_a_client_gone_mid_request_has_it_aborted(dp: DPSetup):
    dp.replicas[0].gate.clear()
    client = AsyncClient(dp.router.address)
    stream = client.generate("hello", PARAMS, "r")
    await anext(stream)
    client.close()  # gone without an abort: the router's next delta to it finds no peer
    dp.replicas[0].gate.set()
    await until(lambda: dp.replicas[0].aborted or not dp.router.requests, what="the request dropped")
    assert dp.router.num_unfinished == [0, 0]


async def test_a_killed_replica_fails_its_own_requests_and_the_others_serve_on(dp: DPSetup):
    for replica in dp.replicas:
        replica.gate.clear()
    client = dp.client()
    on_0 = asyncio.create_task(collect(client, request_id="on0"))
    on_1 = asyncio.create_task(collect(client, request_id="on1"))
    await until(lambda: held(dp, 0) and held(dp, 1), what="one request on each")
    t0 = time.monotonic()
    dp.replicas[0].kill()
    with pytest.raises(EngineDeadError, match=r"replica 0 engine \(tcp://.*\) is dead: no health reply"):
        await asyncio.wait_for(on_0, 5.0)
    assert time.monotonic() - t0 < 2.5  # one health interval and its timeout
    assert not on_1.done()
    assert not await client.health()  # a part is lost
    dp.replicas[1].gate.set()
    assert await on_1 == decode_deltas("on1")
    for n in range(2):  # new requests go to the live replica, and are served
        assert await collect(client, request_id=f"new{n}") == decode_deltas(f"new{n}")
    assert len(held(dp, 1)) == 3 and len(held(dp, 0)) == 1
    stats = await client.stats()
    assert stats["replicas"][0] is None and stats["replicas"][1]["pid"] == 1001
    assert "no health reply" in stats["dp_replicas"][0]["dead_reason"] and stats["dp_replicas"][1]["dead_reason"] is None
    assert stats["is_dead"] is False and stats["dp_num_failed"] == 1


async def test_with_every_replica_dead_requests_are_refused_at_once(dp: DPSetup):
    for replica in dp.replicas:
        replica.kill()
    await until(lambda: not any(link.is_alive for link in dp.router.replicas), 5.0, "both found dead")
    client = dp.client()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="every replica is dead: replica 0 engine .* replica 1 engine"):
        await collect(client)
    assert time.monotonic() - t0 < 0.5
    assert (await client.stats())["is_dead"] is True


async def test_a_replica_that_answers_again_takes_requests_again(dp: DPSetup):
    dp.replicas[0].kill()
    await until(lambda: not dp.router.is_healthy, 5.0, "replica 0 found dead")
    dp.replicas[0].start()  # "restarted" at the same address
    await until(lambda: dp.router.is_healthy, 5.0, "replica 0 back")
    client = dp.client()
    for n in range(2):
        await collect(client, request_id=f"r{n}")
    assert len(held(dp, 0)) == 1 and len(held(dp, 1)) == 1  # both take requests again
    assert await client.health()


async def test_two_clients_may_use_the_same_request_id_and_routers_never_share_an_engine_id(dp: DPSetup):
    dp.replicas[0].gate.clear()
    dp.replicas[1].gate.clear()
    tasks = [asyncio.create_task(collect(dp.client(), request_id="same")) for _ in range(2)]
    await until(lambda: held(dp, 0) and held(dp, 1), what="both routed")
    other = make_router(dp.replicas)  # a second router in front of the same replicas
    await other.connect(5.0)
    serving_other = asyncio.create_task(other.serve())
    client = AsyncClient(other.address)
    try:
        third = asyncio.create_task(collect(client, request_id="same"))
        await until(lambda: len(held(dp, 0)) == 2, what="the other router's request")
        for replica in dp.replicas:
            replica.gate.set()
        assert await asyncio.gather(*tasks, third) == [decode_deltas("same")] * 3
    finally:
        await other.drain_and_stop(0.0)
        await serving_other
        await other.close()
        client.close()
    ids = held(dp, 0) + held(dp, 1)
    assert len(set(ids)) == 3 and all(i.startswith("same.dp") for i in ids)


async def test_one_client_reusing_an_unfinished_id_is_refused(dp: DPSetup):
    dp.replicas[0].gate.clear()
    queue = DealerQueue(dp.router.address)
    try:
        await queue.put(GenerateRequest("r", "hello", PARAMS))
        await queue.put(GenerateRequest("r", "hello", PARAMS))
        await queue.put(GenerateRequest("", "hello", PARAMS))
        replies = [await asyncio.wait_for(queue.get(), 5.0) for _ in range(3)]
        errors = [r for r in replies if isinstance(r, ErrorReply)]
        assert errors == [
            ErrorReply("r", "request_id: duplicate request id 'r'", "invalid_request", "request_id"),
            ErrorReply("", "request_id: must be a non-empty string", "invalid_request", "request_id"),
        ]
        assert len(held(dp, 0)) == 1 and held(dp, 1) == []  # the refused ones reached no replica
        dp.replicas[0].gate.set()
        deltas = [d for r in replies if isinstance(r, RequestDeltas) for d in r.deltas()]
        while not deltas or not deltas[-1].finished:
            frame = await asyncio.wait_for(queue.get(), 5.0)
            deltas += frame.deltas()
        assert deltas == decode_deltas("r")
    finally:
        queue.close()


async def test_draining_fails_what_is_left_with_shutdown_and_refuses_new_requests(dp: DPSetup):
    dp.replicas[0].gate.clear()
    client = dp.client()
    task = asyncio.create_task(collect(client))
    await until(lambda: held(dp, 0), what="the request on replica 0")
    drain = asyncio.create_task(dp.router.drain_and_stop(0.3))
    await until(lambda: dp.router.is_draining, what="draining")
    with pytest.raises(RequestFailedError, match="shutdown: the router is shutting down"):
        await collect(client, request_id="late")
    with pytest.raises(RequestFailedError, match="shutdown: the router shut down"):
        await asyncio.wait_for(task, 5.0)
    await drain
    await until(lambda: dp.replicas[0].aborted, what="abort at replica 0")


async def test_stats_sum_the_replicas_counts_and_keep_each_replicas_own(dp: DPSetup):
    dp.replicas[0].stats = {"num_running": 2, "num_waiting": 1, "num_kv_blocks": 10, "num_free_kv_blocks": 4,
                            "pid": 7, "dtype": "bfloat16", "stage_restarts": 1}  # fmt: skip
    dp.replicas[1].stats = {"num_running": 3, "num_waiting": 0, "num_kv_blocks": 10, "num_free_kv_blocks": 9,
                            "pid": 8, "dtype": "bfloat16", "stage_restarts": 0}  # fmt: skip
    client = dp.client()
    await asyncio.gather(*(collect(client) for _ in range(3)))
    stats = await client.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["num_kv_blocks"], stats["num_free_kv_blocks"]) == (5, 1, 20, 13)
    assert stats["stage_restarts"] == 1 and stats["dtype"] == "bfloat16" and "pid" not in stats
    assert stats["replicas"] == [dp.replicas[0].stats, dp.replicas[1].stats]
    assert stats["dp_num_requests"] == stats["dp_num_finished"] == 3 and stats["dp_size"] == 2
    assert stats["dp_num_routed"] == [2, 1] and stats["dp_num_unfinished"] == [0, 0]
    assert stats["run_id"] == dp.router.router_id and stats["is_dead"] is False and await client.health()


async def test_the_router_holds_no_kv_connector(dp: DPSetup):
    client = dp.client()
    assert await client.kv_handshake() is None
    with pytest.raises(Exception, match="a data-parallel router takes no remote engines"):
        await client.add_remote_engine(EngineHandshake("x", 1, []))


async def test_start_up_waits_for_every_replica_and_names_the_silent_one():
    setup = await serving(2)
    try:
        setup.replicas[1].kill()
        router = make_router(setup.replicas)
        with pytest.raises(TimeoutError, match=r"replica 1 engine \(tcp://.*\): no health reply") as info:
            await router.connect(0.5)
        assert "replica 0" not in str(info.value)
        await router.close()
    finally:
        await setup.close()


def test_a_router_needs_a_replica():
    with pytest.raises(ValueError, match="at least one replica"):
        DPRouter(None, [], 128)
