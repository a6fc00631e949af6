"""Request ids are scoped per client (`runtime.request_ids`): `ClientPort` over real sockets with a
fake sink (two clients with one id each get their own deltas, remote prefills and aborts; one
client reusing a live id is refused), and `RequestIds` alone."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.engine.outputs import RequestOutput
from asyncpp.runtime.client_port import ClientPort
from asyncpp.runtime.request_ids import RequestIds
from asyncpp.wire.client_msgs import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    RemotePrefillDone,
    RequestDelta,
    RequestDeltas,
)
from asyncpp.wire.codec import encode
from asyncpp.wire.queues import DealerQueue, RouterQueue
from tests.runtime.test_client_port_roles import _done, reply

PREFILL = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "k"}


class Sink:
    """Records what it is given, by engine id; `held`: the ids the engine holds (the test frees them)."""

    def __init__(self) -> None:
        self.taken: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.remote: list[RemotePrefillDone] = []
        self.held: set[str] = set()

    def is_slow(self, msg: GenerateRequest) -> bool:
        return False

    def has_request(self, request_id: str) -> bool:
        return request_id in self.held

    async def add_request(self, msg: GenerateRequest) -> None:
        assert msg.request_id not in self.held, "the engine would refuse a duplicate"
        self.taken.append(msg)
        self.held.add(msg.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def add_remote_prefill(self, msg: RemotePrefillDone) -> None:
        self.remote.append(msg)


@pytest.fixture
async def served():
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20)
    sink = Sink()
    replies = {HealthRequest: lambda msg: _done(HealthReply(msg.nonce, True))}
    port = ClientPort(router, sink, replies)
    task = asyncio.create_task(port.serve())
    clients = [DealerQueue(router.address) for _ in range(3)]
    yield port, sink, clients
    for client in clients:
        client.close()
    task.cancel()
    router.close()


async def synced(dealer: DealerQueue, nonce: int) -> None:
    """Wait until the port has handled everything this client sent before (and nothing else came)."""
    await dealer.put(HealthRequest(nonce))
    assert await reply(dealer) == HealthReply(nonce, True)


def frame_of(*deltas: RequestDelta) -> RequestDeltas:
    return RequestDeltas.of(list(deltas))


async def test_two_clients_with_one_id_are_served_apart_and_one_reusing_its_live_id_is_refused(served):
    port, sink, (a, b, _) = served
    async with asyncio.timeout(30):
        await a.put(GenerateRequest("same", "from a"))
        await synced(a, 1)
        await b.put(GenerateRequest("same", "from b"))
        await synced(b, 2)
        engine_id = {msg.prompt: msg.request_id for msg in sink.taken}
        assert engine_id == {"from a": "same", "from b": "same@1"}  # the first keeps its id
        a_id, b_id = engine_id["from a"], engine_id["from b"]

        await port.deliver([RequestOutput(a_id, "A", [1]), RequestOutput(b_id, "B", [2])])
        assert await reply(a) == frame_of(RequestDelta("same", "A", [1]))
        assert await reply(b) == frame_of(RequestDelta("same", "B", [2]))

        await b.put(GenerateRequest("same", "again from b"))
        assert await reply(b) == ErrorReply("same", "duplicate request id 'same'", "invalid_request", "request_id")
        assert len(sink.taken) == 2

        await b.put(RemotePrefillDone("same", {"x": 1}))  # b's own request
        await synced(b, 3)
        assert sink.remote == [RemotePrefillDone(b_id, {"x": 1})]

        await a.put(AbortRequest("same"))  # a's own request, not b's
        await synced(a, 4)
        assert sink.aborted == [a_id] and list(port.peer_of) == [b_id]

        await port.deliver([RequestOutput(a_id, "late", [9]), RequestOutput(b_id, "B2", [3], True, "length")])
        assert await reply(b) == frame_of(RequestDelta("same", "B2", [3], True, "length"))
        await synced(a, 5)  # a got nothing for its aborted request (it would have come first)
        assert port.peer_of == {} and len(port.ids) == 0

        # b's "same" is over; the engine still holds both (a step in flight): a fresh engine id.
        await b.put(GenerateRequest("same", "b once more"))
        await synced(b, 6)
        assert sink.taken[-1].request_id == "same@2"
        sink.held.discard(a_id)
        await a.put(GenerateRequest("same", "a once more"))  # "same" is free again
        await synced(a, 7)
        assert sink.taken[-1].request_id == "same"


async def both_send_r(a: DealerQueue, b: DealerQueue) -> None:
    """Clients a and b each send a request "r" (engine ids "r" and "r@1"), in that order."""
    for client, nonce in ((a, 1), (b, 2)):
        await client.put(GenerateRequest("r", "x"))
        await synced(client, nonce)


async def test_an_error_reaches_the_client_under_its_own_id(served):
    port, sink, (a, b, _) = served
    async with asyncio.timeout(30):
        await both_send_r(a, b)
        await port.send_error("r@1", "engine is dead", "engine_dead")
        assert await reply(b) == ErrorReply("r", "engine is dead", "engine_dead")
        await synced(a, 3)  # nothing for a
        assert list(port.peer_of) == ["r"]


async def test_a_client_gone_aborts_its_own_requests_only(served):
    port, sink, (a, b, _) = served
    async with asyncio.timeout(30):
        await both_send_r(a, b)
        port.drop_peer(port.peer_of["r@1"])
        assert sink.aborted == ["r@1"] and list(port.peer_of) == ["r"]


async def test_a_request_with_kv_transfer_params_keeps_its_id_or_is_refused(served):
    port, sink, (a, b, c) = served
    async with asyncio.timeout(30):
        await a.put(GenerateRequest("k", "x"))
        await synced(a, 1)
        await b.put(GenerateRequest("k", "y", kv_transfer_params=PREFILL))
        refused = await reply(b)
        assert (refused.request_id, refused.kind, refused.field) == ("k", "invalid_request", "request_id")
        assert "in use on this engine" in refused.message
        await c.put(GenerateRequest("k2", "z", kv_transfer_params=PREFILL))
        await synced(c, 2)
        assert [msg.request_id for msg in sink.taken] == ["k", "k2"]


async def test_a_bad_frame_names_the_request_unless_its_client_has_it_live(served):
    port, sink, (a, b, _) = served
    async with asyncio.timeout(30):
        await a.put(GenerateRequest("same", "x"))
        await synced(a, 1)
        truncated = encode(GenerateRequest("same", "hello"))[:-2]
        await a.put_raw(truncated)
        assert (await reply(a)).request_id is None  # else a would take it for the end of its request
        await b.put_raw(truncated)
        assert (await reply(b)).request_id == "same"


def test_request_ids_keep_the_clients_id_while_free_and_derive_one_otherwise():
    ids = RequestIds()
    held = {"x@1"}  # the engine holds a request by that id (a client chose it)
    assert ids.assign(b"a", "x", held.__contains__) == "x"
    assert ids.assign(b"b", "x", held.__contains__) == "x@2"
    assert ids.assign(b"c", "x", held.__contains__, keep=True) is None
    assert ids.engine_id(b"a", "x") == "x" and ids.engine_id(b"b", "x") == "x@2" and ids.engine_id(b"c", "x") is None
    assert ids.client_id("x@2") == "x" and ids.client_id("unknown") == "unknown"
    ids.detach("x")  # a aborted it while it was being taken: its id is its own again, "x" stays reserved
    assert ids.engine_id(b"a", "x") is None and "x" in ids
    assert ids.assign(b"a", "x", held.__contains__) == "x@3"
    ids.release("x")  # the first one's task ended: leaves a's live "x@3" alone
    assert ids.engine_id(b"a", "x") == "x@3" and "x" not in ids and len(ids) == 2
    ids.release("x@3")
    ids.release("x@2")
    assert len(ids) == 0 and ids.engine_id(b"b", "x") is None
