"""`ClientFront`: the router's client side, one task over its ROUTER socket.

Like the engine's `ClientPort`, but a request is known by (client, request
id), not by its id alone: the router multiplexes many clients onto two
engines under ids of its own, so two clients may both use "req-1". Frames
that do not decode get an `ErrorReply` naming what is wrong (under the
request's id where the frame's head names one not in flight, as in an
engine: `bad_frame_reply`); generate and abort messages go to the `RouterSink`, request/reply messages to their
handlers (each in its own task: the router's replies wait on its engines).

Out, everything for one client goes through one ordered outbox, flushed by
one task once the requests woken in this turn of the loop have pushed their
deltas: consecutive deltas become one `RequestDeltas` frame (one per engine
step and client, as from an engine), errors keep their place after them. A
client that is gone (`PeerGoneError`) is reported to the sink once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import fields
from typing import Any, Protocol

from asyncpp.logging import get_logger
from asyncpp.wire.client_msgs import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    RequestDelta,
    RequestDeltas,
    bad_frame_reply,
)
from asyncpp.wire.codec import WireError
from asyncpp.wire.queues import PeerGoneError, RouterQueue

# `RequestDelta`'s fields after its request id, in order: `RequestDeltas`' columns after its ids.
_DELTA_COLUMNS = tuple(f.name for f in fields(RequestDelta))[1:]


class RouterSink(Protocol):
    def add_request(self, peer: bytes, msg: GenerateRequest) -> ErrorReply | None:
        """Take the request, or return the error its client gets."""

    def abort(self, peer: bytes, request_id: str) -> None:
        """The client aborted its request."""

    def drop_peer(self, peer: bytes) -> None:
        """The client is gone: abort its requests."""

    def is_live(self, peer: bytes, request_id: str) -> bool:
        """The client has a request of this id in flight."""


ReplyHandlers = dict[type, Callable[[Any], Awaitable[Any]]]


class ClientFront:
    def __init__(self, queue: RouterQueue, sink: RouterSink, replies: ReplyHandlers, log_role: str = "pd_router") -> None:
        self.queue = queue
        self.sink = sink
        self.replies = replies
        self._outbox: dict[bytes, list[Any]] = {}  # (request id, delta) or a whole message
        self._flushing: asyncio.Task | None = None
        self._reply_tasks: set[asyncio.Task] = set()
        self.log = get_logger(role=log_role)

    async def serve(self) -> None:
        while True:
            peer, msg = await self.queue.get()
            if isinstance(msg, WireError):  # as in an engine: under the request's id, if not a live one's
                reply = bad_frame_reply(msg, lambda request_id: self.sink.is_live(peer, request_id))
                self.log.warning("bad_frame", peer=peer.hex(), request_id=reply.request_id, error=str(msg))
                self.push_error(peer, reply)
            elif isinstance(msg, GenerateRequest):
                if (error := self.sink.add_request(peer, msg)) is not None:
                    self.push_error(peer, error)
            elif isinstance(msg, AbortRequest):
                self.sink.abort(peer, msg.request_id)
            elif (handler := self.replies.get(type(msg))) is not None:
                task = asyncio.create_task(self._reply(peer, handler, msg))
                self._reply_tasks.add(task)
                task.add_done_callback(self._reply_tasks.discard)
            else:
                self.push_error(peer, ErrorReply(None, f"unexpected message {type(msg).__name__}", "bad_frame"))

    async def _reply(self, peer: bytes, handler: Callable[[Any], Awaitable[Any]], msg: Any) -> None:
        try:
            reply = await handler(msg)
        except Exception as e:  # one client's question never ends the router
            self.log.exception("reply_failed", message=type(msg).__name__, error=repr(e))
            reply = ErrorReply(None, repr(e), "internal")
        self._push(peer, reply)

    def push_delta(self, peer: bytes, request_id: str, delta: RequestDelta) -> None:
        """Queue `delta` for `peer` under the client's own `request_id`."""
        self._push(peer, (request_id, delta))

    def push_error(self, peer: bytes, error: ErrorReply) -> None:
        self._push(peer, error)

    def _push(self, peer: bytes, item: Any) -> None:
        self._outbox.setdefault(peer, []).append(item)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._outbox:
                peer = next(iter(self._outbox))
                items = self._outbox.pop(peer)
                try:
                    for frame in _frames(items):
                        await self.queue.put(peer, frame)
                except PeerGoneError:
                    self.sink.drop_peer(peer)
        finally:
            self._flushing = None

    async def close(self) -> None:
        """Send what is queued, then stop answering."""
        if self._flushing is not None:
            await asyncio.shield(self._flushing)
        for task in list(self._reply_tasks):
            task.cancel()
        self.queue.close()


def _frames(items: list[Any]) -> list[Any]:
    """Runs of deltas as one `RequestDeltas` frame each, other messages (errors, replies) in their place."""
    frames: list[Any] = []
    run: list[tuple[str, RequestDelta]] = []
    for item in items:
        if isinstance(item, tuple):  # (request id, delta)
            run.append(item)
        else:
            if run:
                frames.append(_deltas_frame(run))
                run = []
            frames.append(item)
    if run:
        frames.append(_deltas_frame(run))
    return frames


def _deltas_frame(run: list[tuple[str, RequestDelta]]) -> RequestDeltas:
    columns = [[getattr(delta, name) for _, delta in run] for name in _DELTA_COLUMNS]
    return RequestDeltas([request_id for request_id, _ in run], *columns)
