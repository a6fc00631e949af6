"""The router's early handover against fake engines: the decode engine gets each request with the
prefill engine, awaiting it, and the prefill's params follow (`RemotePrefillDone`)."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from asyncpp.errors import EngineDeadError
from asyncpp.wire.client_msgs import RequestDelta
from tests.disagg.conftest import RouterSetup, until
from tests.disagg.fakes import PREFILL_PARAMS, client_deltas

PARAMS = {"max_tokens": 3, "temperature": 0.0, "seed": 5, "stop": ["c"], "logprobs": 2}


async def collect(client: AsyncClient, prompt="hello", params=PARAMS, request_id: str | None = None) -> list:
    return [delta async for delta in client.generate(prompt, params, request_id)]


async def start_prefilling(pd: RouterSetup, client: AsyncClient):
    """A request whose prefill is held ("computing"): (its stream, its first delta to come) once the
    decode engine has it too."""
    pd.prefill.gate.clear()
    stream = client.generate("hello", PARAMS, "r")
    first = asyncio.ensure_future(anext(aiter(stream)))
    await until(lambda: pd.decode.received and pd.prefill.received, what="both engines have the request")
    return stream, first


async def test_the_decode_engine_gets_the_request_while_the_prefill_runs(pd_early: RouterSetup):
    pd = pd_early
    stream, first = await start_prefilling(pd, pd.client())
    [prefill], [decode] = pd.prefill.received, pd.decode.received
    assert prefill.request_id == decode.request_id != "r"
    assert prefill.kv_transfer_params == {"do_remote_decode": True, "decode_engine_id": "decode-0"}
    assert decode.kv_transfer_params == {
        "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": prefill.request_id,
    }  # fmt: skip
    assert decode.sampling_params == PARAMS and prefill.sampling_params == {**PARAMS, "max_tokens": 1}
    assert pd.decode.prefills_done == []
    pd.prefill.gate.set()
    deltas = [await first] + [d async for d in stream]
    assert deltas == client_deltas("r")  # the prefill's token first, then the decode's, unchanged
    [done] = pd.decode.prefills_done
    assert done.request_id == decode.request_id and done.kv_transfer_params == PREFILL_PARAMS  # verbatim
    assert pd.router.counters.num_handovers == 1 and pd.router.requests == {}


async def test_a_request_that_stops_at_its_first_token_aborts_its_decode_request(pd_early: RouterSetup):
    pd = pd_early
    pd.prefill.finish_reason, pd.prefill.kv_transfer_params = "stop", None
    assert await collect(pd.client(), request_id="r") == [RequestDelta("r", "z", [7], True, "stop", None, None, 5, 0)]
    [decode] = pd.decode.received
    await until(lambda: pd.decode.aborted == [decode.request_id], what="the decode request aborted")
    assert pd.decode.prefills_done == [] and pd.router.requests == {}


async def test_one_token_asked_for_never_reaches_the_decode_engine(pd_early: RouterSetup):
    deltas = await collect(pd_early.client(), params={**PARAMS, "max_tokens": 1}, request_id="r")
    assert [d.token_ids for d in deltas] == [[7]] and deltas[-1].finished
    assert pd_early.decode.received == []


async def test_abort_while_prefilling_aborts_both_engines(pd_early: RouterSetup):
    pd = pd_early
    client = pd.client()
    _, task = await start_prefilling(pd, client)
    await client.abort("r")
    rid = pd.prefill.received[0].request_id
    await until(lambda: pd.prefill.aborted == [rid] and pd.decode.aborted == [rid], what="aborted on both")
    task.cancel()
    assert pd.decode.prefills_done == [] and pd.router.requests == {}


async def test_a_decode_engine_refusing_the_awaited_request_fails_it_and_aborts_the_prefill(pd_early: RouterSetup):
    pd = pd_early
    pd.prefill.gate.clear()  # the decode engine's refusal comes first
    with pytest.raises(Exception, match="fake refuses it"):
        await collect(pd.client(), prompt="decode error", request_id="r")
    rid = pd.prefill.received[0].request_id
    await until(lambda: pd.prefill.aborted == [rid], what="the prefill aborted")
    assert pd.router.requests == {}


async def test_a_killed_decode_engine_fails_a_prefilling_request_within_2_s(pd_early: RouterSetup):
    pd = pd_early
    _, task = await start_prefilling(pd, pd.client())
    pd.decode.kill()
    with pytest.raises(EngineDeadError, match="decode engine"):
        await task
    assert pd.router.requests == {}
