"""`ClientPort` in process over real sockets: engine-only messages by role, and requests taken in a
task of their own (slow ones) that an abort, a duplicate or a client gone handle like taken ones."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.runtime.client_port import ClientPort, RequestRefused
from asyncpp.wire.client_auth import ClientAccess
from asyncpp.wire.client_msgs import (
    AbortRequest,
    AddRemoteEngine,
    AddRemoteEngineReply,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    KVHandshakeReply,
    KVHandshakeRequest,
    StatsRequest,
)
from asyncpp.wire.queues import DealerQueue, RouterQueue

SECRET = "engine-secret"


class SlowSink:
    """Requests whose prompt is "slow" are taken once `release` is set."""

    def __init__(self) -> None:
        self.taken: list[str] = []
        self.aborted: list[str] = []
        self.release = asyncio.Event()

    def is_slow(self, msg: GenerateRequest) -> bool:
        return msg.prompt == "slow"

    def has_request(self, request_id: str) -> bool:
        return request_id in self.taken and request_id not in self.aborted

    async def add_request(self, msg: GenerateRequest) -> None:
        if msg.prompt == "refuse":
            raise RequestRefused("no thanks", field="prompt")
        if self.is_slow(msg):
            await self.release.wait()
        self.taken.append(msg.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def add_remote_prefill(self, msg) -> None:
        pass


@pytest.fixture
async def port():
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20, ClientAccess(engine_secret=SECRET))
    sink = SlowSink()
    handshake = EngineHandshake("e", 0, [], b"params key")
    replies = {
        HealthRequest: lambda msg: _done(HealthReply(msg.nonce, True)),
        StatsRequest: lambda msg: _done(HealthReply(msg.nonce, True)),
        KVHandshakeRequest: lambda msg: _done(KVHandshakeReply(msg.nonce, handshake)),
        AddRemoteEngine: lambda msg: _done(AddRemoteEngineReply(msg.nonce)),
    }
    port = ClientPort(router, sink, replies, engine_only=frozenset({KVHandshakeRequest, AddRemoteEngine, StatsRequest}))
    task = asyncio.create_task(port.serve())
    yield port, sink
    task.cancel()
    router.close()


async def _done(value):
    return value


async def reply(dealer: DealerQueue):
    return await asyncio.wait_for(dealer.get(), 5.0)


async def test_engine_only_messages_are_answered_to_the_engine_role_alone(port):
    port, _ = port
    client = DealerQueue(port.router.address)
    engine = DealerQueue(port.router.address, role="engine", secret=SECRET)
    try:
        await client.put(KVHandshakeRequest(7))
        refused = await reply(client)
        assert refused == KVHandshakeReply(7, None, "KVHandshakeRequest needs the engine role (the deployment's engine secret)")
        await client.put(AddRemoteEngine(8, EngineHandshake("x", 0)))
        assert await reply(client) == AddRemoteEngineReply(8, "AddRemoteEngine needs the engine role (the deployment's engine secret)")
        await client.put(StatsRequest(9))  # engine-only here, with no error field of its own
        assert await reply(client) == ErrorReply(None, "StatsRequest needs the engine role (the deployment's engine secret)", "forbidden")
        await client.put(HealthRequest(10))
        assert await reply(client) == HealthReply(10, True)
        await engine.put(KVHandshakeRequest(11))
        answer = await reply(engine)
        assert answer.error is None and answer.handshake.params_key == b"params key"
        await engine.put(AddRemoteEngine(12, EngineHandshake("x", 0)))
        assert await reply(engine) == AddRemoteEngineReply(12)
    finally:
        client.close()
        engine.close()


async def test_a_slow_request_is_taken_beside_the_port_and_an_abort_cancels_it(port):
    port, sink = port
    client, other = DealerQueue(port.router.address), DealerQueue(port.router.address)
    try:
        await client.put(GenerateRequest("a", "slow"))
        await client.put(HealthRequest(1))
        assert await reply(client) == HealthReply(1, True)  # answered while "a" is being taken
        assert list(port.taking) == ["a"] and sink.taken == []
        await client.put(GenerateRequest("a", "slow"))
        assert await reply(client) == ErrorReply("a", "duplicate request id 'a'", "invalid_request", "request_id")
        await other.put(AbortRequest("a"))  # not its request: nothing happens
        await other.put(HealthRequest(2))
        assert await reply(other) == HealthReply(2, True)
        assert list(port.taking) == ["a"]
        await client.put(AbortRequest("a"))
        await client.put(HealthRequest(3))
        assert await reply(client) == HealthReply(3, True)
        assert port.taking == {}
        sink.release.set()
        await asyncio.sleep(0.05)
        assert sink.taken == [] and port.peer_of == {}  # never taken
        await client.put(GenerateRequest("b", "slow"))
        await client.put(GenerateRequest("c", "refuse"))
        assert await reply(client) == ErrorReply("c", "no thanks", "invalid_request", "prompt")
        await client.put(HealthRequest(4))
        assert await reply(client) == HealthReply(4, True)
        assert sink.taken == ["b"] and port.peer_of == {"b": port.peer_of["b"]} and port.taking == {}
    finally:
        client.close()
        other.close()


REMOTE_KV = {"remote_engine_id": "prefill", "remote_request_id": "a"}  # a disaggregated decode's params


async def test_an_abort_while_a_request_naming_remote_kv_is_taken_takes_it_then_aborts_it(port):
    """Cancelled, it would never reach the engine, whose connector alone tells the prefill engine that
    nobody pulls its blocks (held until its pull timeout otherwise): it is taken, then aborted."""
    port, sink = port
    client = DealerQueue(port.router.address)
    try:
        await client.put(GenerateRequest("a", "slow", {}, REMOTE_KV))
        await client.put(AbortRequest("a"))
        await client.put(HealthRequest(1))
        assert await reply(client) == HealthReply(1, True)
        assert list(port.taking) == ["a"] and sink.taken == [] and sink.aborted == []
        await client.put(GenerateRequest("a", "slow"))  # its id is in use until it is aborted
        assert await reply(client) == ErrorReply("a", "duplicate request id 'a'", "invalid_request", "request_id")
        sink.release.set()
        await asyncio.sleep(0.05)
        assert sink.taken == ["a"] and sink.aborted == ["a"]
        assert port.peer_of == {} and port.taking == {} and port.abort_once_taken == set()
        await client.put(GenerateRequest("a", "fast"))  # over: the id is free again, and nothing came for it
        await client.put(HealthRequest(2))
        assert await reply(client) == HealthReply(2, True)
        assert sink.taken == ["a", "a"] and list(port.peer_of) == ["a"]
    finally:
        client.close()


async def test_a_client_gone_cancels_what_is_being_taken_for_it(port):
    """A client gone cancels what is being taken for it, except a request naming another engine's KV:
    that one is taken, then aborted (as on its client's abort)."""
    port, sink = port
    client = DealerQueue(port.router.address)
    try:
        await client.put(GenerateRequest("a", "slow"))
        await client.put(GenerateRequest("b", "slow", {}, REMOTE_KV))
        await client.put(HealthRequest(1))
        assert await reply(client) == HealthReply(1, True)
        peer = port.taking["a"].peer
    finally:
        client.close()
    port.drop_peer(peer)
    sink.release.set()
    await asyncio.sleep(0.05)
    assert sink.taken == ["b"] and sink.aborted == ["b"] and port.taking == {} and port.peer_of == {}


async def test_a_request_naming_remote_kv_refused_after_its_abort_sends_nothing():
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20)

    class Refusing(SlowSink):
        async def add_request(self, msg):
            await self.release.wait()
            raise RequestRefused("too long", field="prompt")

    sink = Refusing()
    port = ClientPort(router, sink, {HealthRequest: lambda msg: _done(HealthReply(msg.nonce, True))})
    task = asyncio.create_task(port.serve())
    client = DealerQueue(router.address)
    try:
        await client.put(GenerateRequest("a", "slow", {}, REMOTE_KV))
        await client.put(AbortRequest("a"))
        await client.put(HealthRequest(1))
        assert await reply(client) == HealthReply(1, True)
        sink.release.set()
        await asyncio.sleep(0.05)
        await client.put(HealthRequest(2))
        assert await reply(client) == HealthReply(2, True)  # no ErrorReply for "a" came first
        assert sink.aborted == [] and port.peer_of == {} and port.taking == {}
    finally:
        client.close()
        task.cancel()
        router.close()


async def test_a_slow_refusal_reaches_its_client():
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20)

    class Refusing(SlowSink):
        async def add_request(self, msg):
            await asyncio.sleep(0.01)
            raise RequestRefused("too long", field="prompt")

    port = ClientPort(router, Refusing(), {})
    task = asyncio.create_task(port.serve())
    client = DealerQueue(router.address)
    try:
        await client.put(GenerateRequest("a", "slow"))
        assert await reply(client) == ErrorReply("a", "too long", "invalid_request", "prompt")
        assert port.peer_of == {} and port.taking == {}
    finally:
        client.close()
        task.cancel()
        router.close()
