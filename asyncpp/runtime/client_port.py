"""`ClientPort`: the engine process's client side, one asyncio task over the ROUTER socket.

It decodes client frames (a bad frame gets an `ErrorReply` naming what is
wrong, and the request it was when its head says so, unless that is one the
client already has running), hands a `GenerateRequest` to the engine's
`RequestSink` and remembers which client (peer) each accepted request belongs
to, routes aborts (and remote prefills done) only from the request's own client, answers request/reply
messages (health, stats, and whatever else the engine registers in `replies`)
and sends each client one `RequestDeltas` frame per step with all of its deltas. A client that is gone
(`PeerGoneError`) has its requests aborted. One client's message never ends
the loop serving all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from asyncpp.engine.outputs import RequestOutput
from asyncpp.logging import get_logger
from asyncpp.wire.client_msgs import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    RemotePrefillDone,
    RequestDeltas,
)
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

    def abort(self, request_id: str) -> None:
        """The client aborted it (or is gone): finish it and free what it holds."""

    async def add_remote_prefill(self, msg: RemotePrefillDone) -> None:
        """The remote prefill of a request of this client is done; a refusal fails the request."""


# A request/reply message type -> its handler, which returns the reply.
ReplyHandlers = dict[type, Callable[[Any], Awaitable[Any]]]


class ClientPort:
    def __init__(self, router: RouterQueue, sink: RequestSink, replies: ReplyHandlers) -> None:
        self.router = router
        self.sink = sink
        self.replies = replies
        self.peer_of: dict[str, bytes] = {}  # unfinished request -> its client
        self.log = get_logger(role="engine", pp_rank=None)

    async def serve(self) -> None:
        while True:
            peer, msg = await self.router.get()
            try:
                await self._handle(peer, msg)
            except PeerGoneError:
                self.drop_peer(peer)
            except Exception as e:
                self.log.exception("client_msg_failed", peer=peer.hex(), error=repr(e))
                await self._reply(peer, ErrorReply(getattr(msg, "request_id", None), repr(e), "internal"))

    async def _handle(self, peer: bytes, msg: Any) -> None:
        if isinstance(msg, WireError):
            request_id = msg.request_id if msg.tag == GenerateRequest.WIRE_TAG else None
            if request_id is not None and self.peer_of.get(request_id) == peer:
                request_id = None  # the client would take it for the end of its running request
            self.log.warning("bad_frame", peer=peer.hex(), request_id=request_id, error=str(msg))
            await self.router.put(peer, ErrorReply(request_id, str(msg), "bad_frame"))
        elif isinstance(msg, GenerateRequest):
            try:
                await self.sink.add_request(msg)
            except RequestRefused as e:
                self.log.info("request_rejected", request_id=msg.request_id, error=str(e), kind=e.kind)
                await self.router.put(peer, ErrorReply(msg.request_id, str(e), e.kind, e.field))
                return
            self.peer_of[msg.request_id] = peer
        elif isinstance(msg, AbortRequest):
            if self.peer_of.get(msg.request_id) == peer:
                del self.peer_of[msg.request_id]
                self.sink.abort(msg.request_id)
        elif isinstance(msg, RemotePrefillDone):
            if self.peer_of.get(msg.request_id) == peer:  # else it is over already (its client knows)
                await self.sink.add_remote_prefill(msg)
        elif (handler := self.replies.get(type(msg))) is not None:
            await self.router.put(peer, await handler(msg))
        else:
            await self.router.put(peer, ErrorReply(None, f"unexpected message {type(msg).__name__}", "bad_frame"))

    async def _reply(self, peer: bytes, msg: Any) -> None:
        try:
            await self.router.put(peer, msg)
        except PeerGoneError:
            self.drop_peer(peer)

    def drop_peer(self, peer: bytes) -> None:
        """The client is gone: abort its requests."""
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
