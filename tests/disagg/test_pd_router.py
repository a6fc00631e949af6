"""The prefill/decode router against fake engines: what clients see, what each engine gets."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from asyncpp.client import AsyncClient, RequestFailedError
from asyncpp.errors import EngineDeadError, InvalidRequestError
from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.wire.client_msgs import ErrorReply, GenerateRequest, RequestDelta, RequestDeltas
from asyncpp.wire.queues import DealerQueue
from tests.disagg.conftest import PREFILL_HANDSHAKE, RouterSetup, make_router, until
from tests.disagg.fakes import ENGINE_SECRET, PREFILL_PARAMS, FakeEngine, client_deltas

PARAMS = {"max_tokens": 3, "temperature": 0.0, "seed": 5, "stop": ["c"], "logprobs": 2}


async def collect(client: AsyncClient, prompt="hello", params=PARAMS, request_id: str | None = None) -> list:
    return [delta async for delta in client.generate(prompt, params, request_id)]


async def raw_error(address: str, msg: GenerateRequest) -> ErrorReply:
    """The exact `ErrorReply` a client gets for `msg` (after the prefill's token, if it got that far)."""
    queue = DealerQueue(address)
    try:
        await queue.put(msg)
        reply = await asyncio.wait_for(queue.get(), 5.0)
        if isinstance(reply, RequestDeltas):
            assert reply.token_ids == [[7]] and reply.finished == [False], reply
            reply = await asyncio.wait_for(queue.get(), 5.0)
        assert isinstance(reply, ErrorReply), reply
        return reply
    finally:
        queue.close()


async def test_decode_deltas_reach_the_client_unchanged_and_params_verbatim(pd: RouterSetup):
    deltas = await collect(pd.client(), request_id="r1")
    # The prefill's token first (unfinished), then the decode's deltas: text, tokens, stop reason,
    # logprobs, counts, last params.
    assert deltas == client_deltas("r1")
    [prefill], [decode] = pd.prefill.received, pd.decode.received
    assert prefill.request_id == decode.request_id != "r1"
    assert prefill.prompt == decode.prompt == "hello"
    assert prefill.sampling_params == {**PARAMS, "max_tokens": 1}  # its token is the client's first
    assert prefill.kv_transfer_params == {"do_remote_decode": True}
    assert decode.sampling_params == PARAMS
    assert decode.kv_transfer_params == PREFILL_PARAMS


async def test_a_request_that_does_not_decode_fails_under_its_own_id(pd: RouterSetup):
    error = await raw_error(pd.router.address, GenerateRequest("odd", 12345, PARAMS))  # a prompt of no known type
    assert (error.request_id, error.kind) == ("odd", "bad_frame") and "prompt" in error.message
    with pytest.raises(InvalidRequestError, match="prompt"):
        await asyncio.wait_for(collect(pd.client(), None, request_id="none"), 5)
    assert pd.prefill.received == [] and pd.decode.received == [] and pd.router.requests == {}


async def test_a_request_that_stops_at_its_first_token_ends_at_the_prefill(pd: RouterSetup):
    pd.prefill.finish_reason, pd.prefill.kv_transfer_params = "stop", None
    assert await collect(pd.client(), request_id="r") == [RequestDelta("r", "z", [7], True, "stop", None, None, 5, 0)]
    assert pd.decode.received == [] and pd.router.requests == {}
    assert (await pd.client().stats())["pd_num_finished"] == 1


async def test_one_token_asked_for_comes_from_the_prefill_engine_alone(pd: RouterSetup):
    pd.prefill.kv_transfer_params = None
    params = {**PARAMS, "max_tokens": 1}
    deltas = await collect(pd.client(), params=params, request_id="r")
    assert deltas == [RequestDelta("r", "z", [7], True, "length", None, None, 5, 0)]
    [prefill] = pd.prefill.received
    assert prefill.sampling_params == params and prefill.kv_transfer_params is None
    assert pd.decode.received == []


async def test_a_prefill_that_hands_out_no_kv_fails_the_request_as_internal(pd: RouterSetup):
    pd.prefill.kv_transfer_params = None  # finished at its length, nothing for the decode engine
    with pytest.raises(RequestFailedError, match=r"internal: prefill engine .* handed out no KV"):
        await collect(pd.client(), request_id="r")
    assert pd.decode.received == [] and pd.router.requests == {}


@pytest.mark.parametrize("role,error", [
    ("prefill", ErrorReply(None, "prompt: too long by 3 tokens", "invalid_request", "prompt")),
    ("decode", ErrorReply(None, "the stage failed: boom", "internal", None)),
    ("decode", ErrorReply(None, "engine shut down before the request finished", "shutdown", None)),
    ("decode", ErrorReply(None, "prompt: empty", "invalid_request", "prompt")),
])  # fmt: skip
async def test_engine_errors_reach_the_client_as_sent(pd: RouterSetup, role, error):
    getattr(pd, role).error = error
    reply = await raw_error(pd.router.address, GenerateRequest("r", f"{role} error", {"max_tokens": 2}))
    assert reply == ErrorReply("r", error.message, error.kind, error.field)
    with pytest.raises(InvalidRequestError if error.kind == "invalid_request" else RequestFailedError) as info:
        await collect(pd.client(), f"{role} error")
    assert error.message in str(info.value)
    assert len(pd.decode.received) == (2 if role == "decode" else 0)  # a prefill error ends it there


async def test_a_decode_engine_refusing_the_prefills_params_is_an_internal_error(pd: RouterSetup):
    pd.decode.expected_params = {"y": 2}
    with pytest.raises(RequestFailedError, match=r"internal: decode engine \(tcp://.*\) refused the router's kv_transfer"):
        await collect(pd.client())


async def test_kv_transfer_params_from_a_client_are_refused(pd: RouterSetup):
    with pytest.raises(InvalidRequestError) as info:
        await anext(aiter(pd.client().generate("hello", PARAMS, kv_transfer_params={"x": 1})))
    assert info.value.field == "kv_transfer_params"
    reply = await raw_error(pd.router.address, GenerateRequest("r", "hello", {}, {"do_remote_decode": True}))
    assert (reply.kind, reply.field) == ("invalid_request", "kv_transfer_params")
    assert pd.prefill.received == [] and pd.decode.received == []


async def test_bad_sampling_params_are_refused_before_a_prefill(pd: RouterSetup):
    reply = await raw_error(pd.router.address, GenerateRequest("r", "hello", {"max_tokens": 0}))
    assert reply == ErrorReply("r", "sampling_params: max_tokens must be >= 1, got 0", "invalid_request", "sampling_params")
    reply = await raw_error(pd.router.address, GenerateRequest("r", "hello", {"max_token": 2}))
    assert reply.field == "sampling_params" and "unknown sampling parameter(s): max_token" in reply.message
    assert pd.prefill.received == []


async def test_abort_while_prefilling_reaches_the_prefill_engine_and_no_decode_starts(pd: RouterSetup):
    pd.prefill.gate.clear()
    task = asyncio.create_task(collect(pd.client(), request_id="r"))
    await until(lambda: pd.prefill.received, what="prefill request")
    task.cancel()  # the client aborts
    await until(lambda: pd.prefill.aborted, what="abort at the prefill engine")
    assert pd.prefill.aborted == [pd.prefill.received[0].request_id]
    pd.prefill.gate.set()
    await asyncio.sleep(0.2)
    assert pd.decode.received == [] and pd.decode.aborted == []
    assert pd.router.requests == {}


async def test_an_abort_as_the_prefill_ends_never_starts_the_decode(pd: RouterSetup):
    """The abort is taken while the prefill's final delta is on its way to the request's task: the
    decode engine gets the request with its abort at once (so that it tells the prefill engine to
    free the blocks held for the params), and the client gets nothing more."""
    real_generate = pd.router.prefill.client.generate

    async def generate_then_abort(*args, **kwargs):
        async for delta in real_generate(*args, **kwargs):
            if delta.finished:
                [(peer, request_id)] = pd.router.requests
                pd.router.abort(peer, request_id)
            yield delta

    pd.router.prefill.client.generate = generate_then_abort
    task = asyncio.create_task(collect(pd.client(), request_id="r"))
    await until(lambda: pd.router.counters.num_aborted, what="abort")
    await until(lambda: pd.decode.aborted, what="abort at the decode engine")
    [decode] = pd.decode.received
    assert decode.kv_transfer_params == PREFILL_PARAMS and pd.decode.aborted == [decode.request_id]
    await asyncio.sleep(0.2)
    assert not task.done()  # no decode delta reached the client
    stats = pd.router.counters.stats()
    assert stats["pd_num_handovers"] == 0 and stats["pd_num_released_after_prefill"] == 1
    task.cancel()


async def test_abort_while_decoding_reaches_the_decode_engine(pd: RouterSetup):
    pd.decode.gate.clear()  # after the first delta
    stream = pd.client().generate("hello", PARAMS, "r")
    assert [await anext(stream), await anext(stream)] == client_deltas("r")[:2]
    await stream.aclose()  # the client breaks out: abort
    await until(lambda: pd.decode.aborted, what="abort at the decode engine")
    assert pd.decode.aborted == [pd.decode.received[0].request_id]
    assert pd.prefill.aborted == []  # its request was over: nothing held there by the router
    assert pd.router.counters.num_aborted == 1


async def test_a_client_gone_mid_request_has_it_aborted(pd: RouterSetup):
    pd.prefill.gate.clear()
    pd.decode.gate.clear()
    queue = DealerQueue(pd.router.address)
    await queue.put(GenerateRequest("r", "hello", PARAMS))
    await until(lambda: pd.prefill.received, what="prefill request")
    queue.close()  # gone; the router learns it when it next sends to it
    await asyncio.sleep(0.1)
    pd.prefill.gate.set()
    await until(lambda: pd.decode.aborted, what="abort at the decode engine")
    assert pd.router.requests == {}


@pytest.mark.parametrize("dead,held", [("prefill", "prefill"), ("decode", "decode"), ("decode", "prefill")])
async def test_a_killed_engine_fails_its_requests_within_2_s(pd: RouterSetup, dead, held):
    getattr(pd, held).gate.clear()
    client = pd.client()
    task = asyncio.create_task(collect(client))
    await until(lambda: getattr(pd, held).received, what=f"{held} request")
    t0 = time.monotonic()
    getattr(pd, dead).kill()
    with pytest.raises(EngineDeadError) as info:
        await asyncio.wait_for(task, 5.0)
    took_s = time.monotonic() - t0
    assert took_s < 2.0, took_s
    assert f"{dead} engine (tcp://" in str(info.value) and "is dead" in str(info.value)
    assert not await client.health()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"{dead} engine"):  # refused at once while it is dead
        await collect(client)
    assert time.monotonic() - t0 < 0.5
    stats = await client.stats()
    assert stats["is_dead"] and stats[dead] is None and stats["pd_engines"][dead]["dead_reason"]
    if held == "prefill" and dead == "decode":  # the prefill engine was told to drop it
        await until(lambda: pd.prefill.aborted, what="abort at the prefill engine")


async def test_an_engine_that_answers_again_serves_again(pd: RouterSetup):
    pd.prefill.kill()
    await until(lambda: not pd.router.is_healthy, 3.0, "prefill found dead")
    num_handshakes = pd.prefill.num_handshake_requests
    pd.prefill.start()  # "restarted" at the same address
    await until(lambda: pd.router.is_healthy, 3.0, "prefill back")
    assert pd.prefill.num_handshake_requests > num_handshakes  # exchanged anew before it serves
    assert await collect(pd.client(), request_id="r") == client_deltas("r")


async def test_stats_merge_both_engines_under_the_decode_engines(pd: RouterSetup):
    pd.decode.stats = {"num_running": 2, "num_waiting": 1, "num_kv_blocks": 10, "num_free_kv_blocks": 4, "is_dead": False}
    pd.prefill.stats = {"num_running": 7, "num_prompt_tokens": 99}
    client = pd.client()
    await asyncio.gather(*(collect(client) for _ in range(3)))
    stats = await client.stats()
    assert stats["num_running"] == 2 and stats["num_kv_blocks"] == 10  # the decode engine's, for /metrics
    assert stats["prefill"] == pd.prefill.stats and stats["decode"] == pd.decode.stats
    assert stats["pd_num_requests"] == stats["pd_num_handovers"] == stats["pd_num_finished"] == 3
    for key in ("pd_second_token_s_mean", "pd_second_token_s_p50", "pd_second_token_s_p99", "pd_prefill_s_mean"):
        assert 0 < stats[key] < 1, (key, stats[key])
    assert stats["is_dead"] is False and await client.health()


async def test_handshakes_are_exchanged_at_start_up_once_both_answer():
    decode_handshake = EngineHandshake("decode-0", 2, [])
    prefill = FakeEngine("prefill", PREFILL_HANDSHAKE).start()
    decode = FakeEngine("decode", decode_handshake)  # not answering yet
    router = make_router(prefill, decode)
    setup = RouterSetup(prefill, decode, router)
    try:
        connecting = asyncio.create_task(router.connect(10.0))
        await asyncio.sleep(0.5)
        assert not connecting.done() and decode.remote_engines == []
        decode.start()
        await asyncio.wait_for(connecting, 5.0)
        assert decode.remote_engines == [PREFILL_HANDSHAKE]
        assert prefill.remote_engines == [decode_handshake]
    finally:
        await setup.close()


async def test_a_none_handshake_is_not_passed_on():
    prefill, decode = FakeEngine("prefill").start(), FakeEngine("decode").start()
    setup = RouterSetup(prefill, decode, make_router(prefill, decode))
    try:
        await setup.router.connect(5.0)
        assert prefill.remote_engines == [] and decode.remote_engines == []
    finally:
        await setup.close()


async def test_two_clients_may_use_the_same_request_id(pd: RouterSetup):
    pd.decode.gate.clear()  # both in flight at once
    tasks = [asyncio.create_task(collect(pd.client(), request_id="same")) for _ in range(2)]
    await until(lambda: len(pd.decode.received) == 2, what="both decode requests")
    pd.decode.gate.set()
    assert await asyncio.gather(*tasks) == [client_deltas("same")] * 2
    ids = {msg.request_id for msg in pd.decode.received}
    assert len(ids) == 2 and ids == {msg.request_id for msg in pd.prefill.received}


async def test_routers_in_front_of_the_same_engines_never_share_an_engine_request_id(pd: RouterSetup):
    # Router A's request stays live on the decode engine while a second router B, and then B
    # restarted (its request counter starting over), send a request with the same client id.
    pd.decode.gate.clear()
    a = asyncio.create_task(collect(pd.client(), request_id="same"))
    await until(lambda: len(pd.decode.received) == 1, what="router A's decode request")
    tasks = []
    for n in (2, 3):  # B, then B after a restart
        router = make_router(pd.prefill, pd.decode)
        await router.connect(5.0)
        serving = asyncio.create_task(router.serve())
        client = AsyncClient(router.address)
        try:
            tasks.append(asyncio.create_task(collect(client, request_id="same")))
            await until(lambda: len(pd.decode.received) == n, what=f"decode request {n}")
            await router.drain_and_stop(0.0)  # fails B's request for its client: B goes down
            with pytest.raises(RequestFailedError, match="shutdown"):  # before its client closes (else it waits forever)
                await asyncio.wait_for(tasks[-1], 10.0)
            await serving
            await router.close()
        finally:
            client.close()
    pd.decode.gate.set()
    assert await a == client_deltas("same")  # A's request was never disturbed
    ids = [msg.request_id for msg in pd.decode.received]
    assert len(set(ids)) == 3, ids
    assert [msg.request_id for msg in pd.prefill.received] == ids
    assert all(i.startswith("same.pd") for i in ids)


async def test_one_client_reusing_an_unfinished_id_is_refused(pd: RouterSetup):
    pd.prefill.gate.clear()
    queue = DealerQueue(pd.router.address)
    try:
        await queue.put(GenerateRequest("r", "hello", PARAMS))
        await queue.put(GenerateRequest("r", "hello", PARAMS))
        reply = await asyncio.wait_for(queue.get(), 5.0)
        assert reply == ErrorReply("r", "request_id: duplicate request id 'r'", "invalid_request", "request_id")
        pd.prefill.gate.set()
        deltas = []
        while not deltas or not deltas[-1].finished:  # the router may batch them into fewer frames
            frame = await asyncio.wait_for(queue.get(), 5.0)
            assert isinstance(frame, RequestDeltas), frame
            deltas += frame.deltas()
        assert deltas == client_deltas("r")
    finally:
        queue.close()


async def test_draining_fails_what_is_left_with_shutdown(pd: RouterSetup):
    pd.decode.gate.clear()
    task = asyncio.create_task(collect(pd.client()))
    await until(lambda: pd.decode.received, what="decode request")
    await pd.router.drain_and_stop(0.2)
    with pytest.raises(RequestFailedError, match="shutdown: the router shut down"):
        await asyncio.wait_for(task, 5.0)
    await until(lambda: pd.decode.aborted, what="abort at the decode engine")


def test_the_router_alone_needs_the_engines_secret_and_a_client_secret_off_loopback():
    """Without ASYNCPP_ENGINE_SECRET it could not hold the engine role; off loopback it needs a client secret."""
    base = [sys.executable, "-m", "asyncpp.disagg", "--prefill", "tcp://127.0.0.1:1", "--decode", "tcp://127.0.0.1:2"]
    env = {k: v for k, v in os.environ.items() if k not in ("ASYNCPP_ENGINE_SECRET", "ASYNCPP_CLIENT_SECRET")}
    done = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "set ASYNCPP_ENGINE_SECRET" in done.stderr
    env["ASYNCPP_ENGINE_SECRET"] = ENGINE_SECRET
    done = subprocess.run([*base, "--host", "0.0.0.0", "--port", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not on loopback: set server.client_secret" in done.stderr


async def test_the_router_alone_in_front_of_running_engines(pd: RouterSetup):
    """`python -m asyncpp.disagg`: the same router as its own process, stopped by SIGTERM."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncpp.disagg", "--prefill", pd.prefill.address, "--decode", pd.decode.address,
        "--port", "0", "--log-level", "warning", stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "ASYNCPP_ENGINE_SECRET": ENGINE_SECRET},
    )  # fmt: skip
    try:
        line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
        address = re.search(r"asyncpp ready: clients connect to (\S+)", line).group(1)
        client = AsyncClient(address)
        try:
            assert await collect(client, request_id="r") == client_deltas("r")
        finally:
            client.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
