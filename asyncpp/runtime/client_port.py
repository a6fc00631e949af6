"""`ClientPort`: the engine process's client side, one asyncio task over the ROUTER socket.

It decodes client frames (a bad frame gets an `ErrorReply` naming what is
wrong, and the request it was when its head says so, unless that is one the
client already has live), hands a `GenerateRequest` to the engine's
`RequestSink` and remembers which client (peer) each accepted request belongs
to. Request ids are scoped per client, as behind the PD router
(`request_ids`): each request gets an engine id unique inside the engine (the
client's own while no other request has it), the sink and the engine
know it by that, and its client by its own: deltas and errors go out under
the client's id, aborts (and remote prefills done) act only on the sending
client's own request. A client reusing an id it has live is refused
("duplicate request id"). The port answers request/reply messages (health,
stats, and whatever else the engine registers in `replies`) and sends each
client one `RequestDeltas` frame per step with all of its deltas. A client
that is gone (`PeerGoneError`) has its requests aborted. One client's message
never ends the loop serving all, and never holds it up: a request the sink
takes slowly (a huge prompt tokenized off the loop) is taken in a task of its
own while the port goes on reading (an abort meanwhile cancels it, unless its
`kv_transfer_params` name another engine's blocks: it is then taken and aborted
at once, so that the engine's connector tells that engine nobody pulls them),
so health answers stay prompt under any load. Messages in `engine_only` (KV handshakes,
remote engines) are answered only to peers in the engine role
(`wire.client_auth`); any other peer gets a "forbidden" error, never the
handshake and its signing key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

import structlog

from asyncpp.engine.outputs import RequestOutput
from asyncpp.logging import get_logger
from asyncpp.runtime.request_ids import RequestIds
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
    bad_frame_reply,
)
from asyncpp.wire.client_auth import ENGINE
from asyncpp.wire.codec import WireError
from asyncpp.wire.queues import PeerGoneError, RouterQueue


class Taking(NamedTuple):
    """A request being taken in a task of its own."""

    peer: bytes  # its client
    task: asyncio.Task
    names_remote_kv: bool  # its kv_transfer_params name another engine's blocks


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

    def has_request(self, request_id: str) -> bool:
        """Whether the engine holds a request by this id (one finished but still in a step in
        flight, or whose blocks a remote engine still pulls, counts)."""

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
        # Keyed by engine request id (`request_ids`): what the sink and the engine know requests by.
        self.peer_of: dict[str, bytes] = {}  # unfinished request -> its client
        self.taking: dict[str, Taking] = {}  # requests taken in a task of their own
        self.abort_once_taken: set[str] = set()  # of those, the ones their client aborted (`_stop_taking`)
        self.ids = RequestIds()  # (client, its id) <-> engine id, for every request taken or being taken
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
            reply = bad_frame_reply(msg, lambda request_id: self.ids.engine_id(peer, request_id) is not None)
            self.log.warning("bad_frame", peer=peer.hex(), request_id=reply.request_id, error=str(msg))
            await self.router.put(peer, reply)
        elif isinstance(msg, GenerateRequest):
            await self._admit(peer, msg)
        elif isinstance(msg, AbortRequest):
            self._abort(peer, msg.request_id)
        elif type(msg) in self.engine_only and role != ENGINE:
            self.log.warning("engine_role_refused", peer=peer.hex(), role=role, message=type(msg).__name__)
            error = f"{type(msg).__name__} needs the engine role (the deployment's engine secret)"
            await self.router.put(peer, _refusal(msg, error))
        elif isinstance(msg, RemotePrefillDone):
            engine_id = self.ids.engine_id(peer, msg.request_id)
            if engine_id is not None and engine_id in self.peer_of:  # else it is over already (its client knows)
                with _client_context(engine_id, msg.request_id):
                    await self.sink.add_remote_prefill(dataclasses.replace(msg, request_id=engine_id))
        elif (handler := self.replies.get(type(msg))) is not None:
            await self.router.put(peer, await handler(msg))
        else:
            await self.router.put(peer, ErrorReply(None, f"unexpected message {type(msg).__name__}", "bad_frame"))

    async def _admit(self, peer: bytes, msg: GenerateRequest) -> None:
        """Give the request an engine id (`request_ids`) and take it, in a task of its own if slow."""
        client_id = msg.request_id
        if self.ids.engine_id(peer, client_id) is not None:
            error = f"duplicate request id {client_id!r}"
            await self.router.put(peer, ErrorReply(client_id, error, "invalid_request", "request_id"))
            return
        keep = msg.kv_transfer_params is not None  # other engines may name it by its id
        engine_id = self.ids.assign(peer, client_id, self.sink.has_request, keep)
        if engine_id is None:
            error = (
                f"request id {client_id!r} is in use on this engine; a request with kv_transfer_params keeps "
                "its id (other engines name it by it)"
            )
            self.log.info("request_rejected", request_id=client_id, peer=peer.hex(), error=error, kind="invalid_request")
            await self.router.put(peer, ErrorReply(client_id, error, "invalid_request", "request_id"))
            return
        if engine_id != client_id:
            self.log.info("request_id_derived", request_id=engine_id, client_request_id=client_id, peer=peer.hex())
            msg = dataclasses.replace(msg, request_id=engine_id)
        if self.sink.is_slow(msg):
            task = asyncio.create_task(self._take(peer, client_id, msg))
            self.taking[engine_id] = Taking(peer, task, msg.kv_transfer_params is not None)
            task.add_done_callback(lambda done: self._taken(engine_id, done))
        else:
            await self._take(peer, client_id, msg)

    def _taken(self, engine_id: str, task: asyncio.Task) -> None:
        entry = self.taking.get(engine_id)
        if entry is not None and entry.task is task:
            del self.taking[engine_id]
            self.abort_once_taken.discard(engine_id)

    def _stop_taking(self, engine_id: str) -> None:
        """The client aborted a request not taken yet (or is gone). Cancelled, it never reaches the engine;
        but one whose params name another engine's blocks (a disaggregated decode) would leave them held
        there until that engine's pull timeout: it is taken all the same and aborted at once (`_take`), so
        that the connector releases them, as for a request aborted once taken."""
        if self.taking[engine_id].names_remote_kv:
            self.abort_once_taken.add(engine_id)
            return
        self.taking.pop(engine_id).task.cancel()  # never taken (the task frees its engine id)
        self.ids.detach(engine_id)  # the client may use its id again at once

    async def _take(self, peer: bytes, client_id: str, msg: GenerateRequest) -> None:
        """`msg` under its engine id: into the sink, or its client hears why not."""
        engine_id = msg.request_id
        with _client_context(engine_id, client_id):
            try:
                await self.sink.add_request(msg)
            except BaseException as e:
                self.ids.release(engine_id)  # never taken (refused, failed, or cancelled by an abort)
                if engine_id in self.abort_once_taken and isinstance(e, Exception):
                    self.log.info("request_not_taken", request_id=engine_id, error=str(e))  # its client is gone
                elif isinstance(e, RequestRefused):
                    self.log.info("request_rejected", request_id=engine_id, error=str(e), kind=e.kind)
                    await self._reply(peer, ErrorReply(client_id, str(e), e.kind, e.field))
                elif isinstance(e, Exception):  # a request taken in its own task: nobody else reports it
                    self.log.exception("client_msg_failed", peer=peer.hex(), request_id=engine_id, error=repr(e))
                    await self._reply(peer, ErrorReply(client_id, repr(e), "internal"))
                else:
                    raise
                return
        self.peer_of[engine_id] = peer
        if engine_id in self.abort_once_taken:  # aborted while being taken (`_stop_taking`)
            self._end(engine_id)
            with _client_context(engine_id, client_id):
                self.sink.abort(engine_id)

    def _abort(self, peer: bytes, client_id: str) -> None:
        """The client's abort: only of its own live request."""
        engine_id = self.ids.engine_id(peer, client_id)
        if engine_id is None:
            return
        if engine_id in self.peer_of:
            self._end(engine_id)
            with _client_context(engine_id, client_id):
                self.sink.abort(engine_id)
        elif engine_id in self.taking:
            self._stop_taking(engine_id)

    def _end(self, engine_id: str) -> None:
        """The request is over for its client."""
        del self.peer_of[engine_id]
        self.ids.release(engine_id)

    async def _reply(self, peer: bytes, msg: Any) -> None:
        try:
            await self.router.put(peer, msg)
        except PeerGoneError:
            self.drop_peer(peer)

    def drop_peer(self, peer: bytes) -> None:
        """The client is gone: abort its requests."""
        for engine_id, entry in list(self.taking.items()):
            if entry.peer == peer:
                self._stop_taking(engine_id)
        gone = [engine_id for engine_id, p in self.peer_of.items() if p == peer]
        for engine_id in gone:
            client_id = self.ids.client_id(engine_id)
            self._end(engine_id)
            with _client_context(engine_id, client_id):
                self.sink.abort(engine_id)
        if gone:
            self.log.info("client_gone", peer=peer.hex(), num_aborted=len(gone))

    async def send_error(self, request_id: str, message: str, kind: str, error_field: str | None = None) -> None:
        """The request (by engine id) is over with an error: tell its client (if it still has one) why."""
        peer = self.peer_of.get(request_id)
        if peer is None:
            return
        client_id = self.ids.client_id(request_id)
        self._end(request_id)
        try:
            await self.router.put(peer, ErrorReply(client_id, message, kind, error_field))
        except PeerGoneError:
            self.drop_peer(peer)

    async def deliver(self, outputs: list[RequestOutput]) -> None:
        """Send one step's deltas: one `RequestDeltas` frame per client, under the client's ids."""
        by_peer: dict[bytes, list[RequestOutput]] = {}
        finished: list[str] = []
        for out in outputs:
            peer = self.peer_of.get(out.request_id)
            if peer is None:
                continue
            if out.finished:
                del self.peer_of[out.request_id]
                finished.append(out.request_id)
            by_peer.setdefault(peer, []).append(out)
        derived = self.ids.derived
        frames = [(peer, _under_client_ids(RequestDeltas.of(outs), derived)) for peer, outs in by_peer.items()]
        for engine_id in finished:  # once their frames name them as their clients do
            self.ids.release(engine_id)
        gone: list[bytes] = []
        for peer, frame in frames:
            try:
                await self.router.put(peer, frame)
            except PeerGoneError:
                gone.append(peer)
        for peer in gone:
            self.drop_peer(peer)


def _under_client_ids(frame: RequestDeltas, derived: dict[str, str]) -> RequestDeltas:
    """The frame with each derived engine id replaced by its client's id (most steps have none)."""
    if not derived or not any(engine_id in derived for engine_id in frame.request_ids):
        return frame
    return dataclasses.replace(frame, request_ids=[derived.get(i, i) for i in frame.request_ids])


def _client_context(engine_id: str, client_id: str) -> contextlib.AbstractContextManager:
    """Log events (the engine's too) carry the client's id beside the engine's where they differ."""
    if engine_id == client_id:
        return contextlib.nullcontext()
    return structlog.contextvars.bound_contextvars(client_request_id=client_id)


def _refusal(msg: Any, error: str) -> Any:
    """The reply a peer without the engine role gets: its call's own reply type where it has an
    error to carry (so the call ends at once), else an `ErrorReply`."""
    if isinstance(msg, KVHandshakeRequest):
        return KVHandshakeReply(msg.nonce, None, error)
    if isinstance(msg, AddRemoteEngine):
        return AddRemoteEngineReply(msg.nonce, error)
    return ErrorReply(None, error, "forbidden")
