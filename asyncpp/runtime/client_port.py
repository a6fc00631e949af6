"""`ClientPort`: the engine process's client side, one asyncio task over the ROUTER socket.

It decodes client frames (a bad frame gets an `ErrorReply` naming what is
wrong, and the request it was when its head says so, unless that is one the
client already has running), hands a `GenerateRequest` to the engine's
`RequestSink` and remembers which client (peer) each accepted request belongs
to, routes aborts (and remote prefills done) only from the request's own client, answers request/reply
messages (health, stats, and whatever else the engine registers in `replies`)
and sends each client one `RequestDeltas` frame per step with all of its deltas. A client that is gone
(`PeerGoneError`) has its requests aborted. One client's message never ends
the loop serving all, and never holds it up: a request the sink takes
slowly (a huge prompt tokenized off the loop) is taken in a task of its own
while the port goes on reading (an abort meanwhile cancels it), so health
answers stay prompt under any load. Messages in `engine_only` (KV handshakes,
remote engines) are answered only to peers in the engine role
(`wire.client_auth`); any other peer gets a "forbidden" error, never the
handshake and its signing key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from asyncpp.engine.outputs import RequestOutput
from asyncpp.logging import get_logger
from asyncpp.wire.client_msgs import (
    AbortRequest,
    AddRemoteEngine,
    AddRemoteEngineReply,
    ErrorReply,
    GenerateRequest,
    KVHandshakeReply,
    KVHandshakeRequest,
    RemotePrefillDone,
    RequestDeltas,
)
from asyncpp.wire.client_auth import ENGINE
from asyncpp.wire.codec import WireError
from asyncpp.wire.queues import PeerGoneError, RouterQueue


class RequestRefused(Exception):
    """A request the engine does not take: the client gets an `ErrorReply` of this kind."""

    def __init__(self, message: str, kind: str = "invalid_request", field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.field = field


class RequestSink(Protocol):
    """What the port needs of the engine."""

    async def add_request(self, msg: GenerateRequest) -> None:
        """Take the request, or raise `RequestRefused`."""

    def is_slow(self, msg: GenerateRequest) -> bool:
        """Whether taking it awaits work off the loop (it is then taken in a task of its own)."""

    def abort(self, request_id: str) -> None:
        """The client aborted it (or is gone): finish it and free what it holds."""

    async def add_remote_prefill(self, msg: RemotePrefillDone) -> None:
        """The remote prefill of a request of this client is done; a refusal fails the request."""


# A request/reply message type -> its handler, which returns the reply.
ReplyHandlers = dict[type, Callable[[Any], Awaitable[Any]]]


class ClientPort:
    def __init__(
        self, router: RouterQueue, sink: RequestSink, replies: ReplyHandlers, engine_only: frozenset[type] = frozenset()
    ) -> None:
        self.router = router
        self.sink = sink
        self.replies = replies
        self.engine_only = engine_only  # message types only the engine role may send
        self.peer_of: dict[str, bytes] = {}  # unfinished request -> its client
        self.taking: dict[str, tuple[bytes, asyncio.Task]] = {}  # requests taken in a task of their own
        self.log = get_logger(role="engine", pp_rank=None)

    async def serve(self) -> None:
        while True:
            peer, role, msg = await self.router.get_with_role()
            try:
                await self._handle(peer, role, msg)
            except PeerGoneError:
                self.drop_peer(peer)
            except Exception as e:
                self.log.exception("client_msg_failed", peer=peer.hex(), error=repr(e))
                await self._reply(peer, ErrorReply(getattr(msg, "request_id", None), repr(e), "internal"))

    async def _handle(self, peer: bytes, role: str, msg: Any) -> None:
        if isinstance(msg, WireError):
            request_id = msg.request_id if msg.tag == GenerateRequest.WIRE_TAG else None
            if request_id is not None and self.peer_of.get(request_id) == peer:
                request_id = None  # the client would take it for the end of its running request
            self.log.warning("bad_frame", peer=peer.hex(), request_id=request_id, error=str(msg))
            await self.router.put(peer, ErrorReply(request_id, str(msg), "bad_frame"))
        elif isinstance(msg, GenerateRequest):
            if msg.request_id in self.taking:
                await self.router.put(peer, ErrorReply(msg.request_id, f"duplicate request id {msg.request_id!r}"))
            elif self.sink.is_slow(msg):
                task = asyncio.create_task(self._take(peer, msg))
                self.taking[msg.request_id] = (peer, task)
                task.add_done_callback(lambda done, request_id=msg.request_id: self._taken(request_id, done))
            else:
                await self._take(peer, msg)
        elif isinstance(msg, AbortRequest):
            if self.peer_of.get(msg.request_id) == peer:
                del self.peer_of[msg.request_id]
                self.sink.abort(msg.request_id)
            elif self.taking.get(msg.request_id, (None,))[0] == peer:
                self.taking.pop(msg.request_id)[1].cancel()  # not taken yet: never will be
        elif type(msg) in self.engine_only and role != ENGINE:
            self.log.warning("engine_role_refused", peer=peer.hex(), role=role, message=type(msg).__name__)
            error = f"{type(msg).__name__} needs the engine role (the deployment's engine secret)"
            await self.router.put(peer, _refusal(msg, error))
        elif isinstance(msg, RemotePrefillDone):
            if self.peer_of.get(msg.request_id) == peer:  # else it is over already (its client knows)
                await self.sink.add_remote_prefill(msg)
        elif (handler := self.replies.get(type(msg))) is not None:
            await self.router.put(peer, await handler(msg))
        else:
            await self.router.put(peer, ErrorReply(None, f"unexpected message {type(msg).__name__}", "bad_frame"))

    def _taken(self, request_id: str, task: asyncio.Task) -> None:
        if self.taking.get(request_id, (None, None))[1] is task:
            del self.taking[request_id]

    async def _take(self, peer: bytes, msg: GenerateRequest) -> None:
        try:
            await self.sink.add_request(msg)
        except RequestRefused as e:
            self.log.info("request_rejected", request_id=msg.request_id, error=str(e), kind=e.kind)
            await self._reply(peer, ErrorReply(msg.request_id, str(e), e.kind, e.field))
            return
        except Exception as e:  # a request taken in its own task: nobody else reports it
            self.log.exception("client_msg_failed", peer=peer.hex(), error=repr(e))
            await self._reply(peer, ErrorReply(msg.request_id, repr(e), "internal"))
            return
        self.peer_of[msg.request_id] = peer

    async def _reply(self, peer: bytes, msg: Any) -> None:
        try:
            await self.router.put(peer, msg)
        except PeerGoneError:
            self.drop_peer(peer)

    def drop_peer(self, peer: bytes) -> None:
        """The client is gone: abort its requests."""
        for request_id, (p, task) in list(self.taking.items()):
            if p == peer:
                task.cancel()
        gone = [request_id for request_id, p in self.peer_of.items() if p == peer]
        for request_id in gone:
            del self.peer_of[request_id]
            self.sink.abort(request_id)
        if gone:
            self.log.info("client_gone", peer=peer.hex(), num_aborted=len(gone))

    async def send_error(self, request_id: str, message: str, kind: str, error_field: str | None = None) -> None:
        """The request is over with an error: tell its client (if it still has one) why."""
        peer = self.peer_of.pop(request_id, None)
        if peer is None:
            return
        try:
            await self.router.put(peer, ErrorReply(request_id, message, kind, error_field))
        except PeerGoneError:
            self.drop_peer(peer)

    async def deliver(self, outputs: list[RequestOutput]) -> None:
        """Send one step's deltas: one `RequestDeltas` frame per client."""
        by_peer: dict[bytes, list[RequestOutput]] = {}
        for out in outputs:
            peer = self.peer_of.get(out.request_id)
            if peer is None:
                continue
            if out.finished:
                del self.peer_of[out.request_id]
            by_peer.setdefault(peer, []).append(out)
        gone: list[bytes] = []
        for peer, peer_outputs in by_peer.items():
            try:
                await self.router.put(peer, RequestDeltas.of(peer_outputs))
            except PeerGoneError:
                gone.append(peer)
        for peer in gone:
            self.drop_peer(peer)


def _refusal(msg: Any, error: str) -> Any:
    """The reply a peer without the engine role gets: its call's own reply type where it has an
    error to carry (so the call ends at once), else an `ErrorReply`."""
    if isinstance(msg, KVHandshakeRequest):
        return KVHandshakeReply(msg.nonce, None, error)
    if isinstance(msg, AddRemoteEngine):
        return AddRemoteEngineReply(msg.nonce, error)
    return ErrorReply(None, error, "forbidden")
