"""`AsyncClient`: talk to a running asyncpp engine.

    client = AsyncClient("tcp://127.0.0.1:5557")
    async for delta in client.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.text, end="")

Many `generate` calls can run concurrently over one client: a single reader
task routes replies by request id. Request ids are this client's own: another
client may use the same id at once (on one engine as behind the PD router);
this one may not reuse an id it has live (`InvalidRequestError`, here and in
the engine). Breaking out of the loop, or cancelling the task, aborts the
request in the engine, and so does `end_all`. A request whose frame would be
over `max_frame_bytes` (the engine's `server.max_frame_bytes`) is refused
here, naming its largest field, instead of being sent.

An engine whose port has `server.client_secret` serves only clients that
present it (`secret`); the KV handshake calls need the engine role
(`role="engine"` with the deployment's engine secret: `wire.client_auth`).

ZMQ connects and reconnects without a word, to whatever process listens at
the address then. `is_connected` says whether a connection is up now, and
`on_connection` listeners hear of each one made or lost (the HTTP server
serves one engine run: `http.engine_guard`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from asyncpp.errors import EngineDeadError, InvalidRequestError
from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_msgs import (
    AbortRequest,
    RemotePrefillDone,
    AddRemoteEngine,
    AddRemoteEngineReply,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    KVHandshakeReply,
    KVHandshakeRequest,
    RequestDelta,
    RequestDeltas,
    StatsReply,
    StatsRequest,
)
from asyncpp.wire.client_auth import CLIENT
from asyncpp.wire.codec import packed_size
from asyncpp.wire.queues import CONNECTED, REFUSED, DealerQueue, FrameTooLargeError

_REPLIES = (HealthReply, StatsReply, KVHandshakeReply, AddRemoteEngineReply)  # matched to calls by nonce


class RequestFailedError(RuntimeError):
    """The engine failed a request for a reason other than bad input; `kind` says which
    (`internal`, `shutdown`, ... as in `ErrorReply`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class ClientRefusedError(PermissionError):
    """The engine's port refused this client's credentials (`secret`, `role`): nothing it sends is read."""


class AsyncClient:
    def __init__(
        self, address: str, max_frame_bytes: int | None = None, *, secret: str = "", role: str = CLIENT,
        watch_connection: bool = False,
    ) -> None:  # fmt: skip
        self.address = address
        self._queue = DealerQueue(address, max_frame_bytes, role, secret, watch_connection)
        self.watches_connection = watch_connection  # `on_connection` needs it
        self._streams: dict[str, _Stream] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._nonces = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self.refused: str | None = None  # why the engine refused our credentials, once it has
        self._refusal: asyncio.Future | None = None  # done once it has
        self.is_connected = False  # a connection to the engine is up (its handshake done)
        self._connection_listeners: list[Callable[[bool], None]] = []
        # Errors about frames that named no request (the latest few).
        self.unrouted_errors: collections.deque[ErrorReply] = collections.deque(maxlen=64)

    def _ensure_reader(self) -> None:
        if self.refused is not None:
            raise ClientRefusedError(self.refused)
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read_loop())
        if self._watcher is None or self._watcher.done():
            self._watcher = loop.create_task(self._watch_connection())

    async def _put(self, msg: Any) -> None:
        """Send `msg`; `ClientRefusedError` if the engine refused us (ZMQ then drops the connection, and a
        send that has to wait would wait forever)."""
        if self.refused is not None:
            raise ClientRefusedError(self.refused)
        if self._refusal is None:
            self._refusal = asyncio.get_running_loop().create_future()
        put = asyncio.ensure_future(self._queue.put(msg))
        await asyncio.wait({put, self._refusal}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            raise ClientRefusedError(self.refused)
        put.result()

    def on_connection(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(True)` each time a connection to the engine is made, `listener(False)` each
        time it is lost (at once with True if one is up now; in a running loop)."""
        if not self.watches_connection:
            raise RuntimeError("on_connection needs an AsyncClient made with watch_connection=True")
        self._connection_listeners.append(listener)
        self._ensure_reader()
        if self.is_connected:
            listener(True)

    async def _watch_connection(self) -> None:
        while True:
            kind, reason = await self._queue.next_event()
            if kind == REFUSED:
                self._refuse(reason)
                return
            self.is_connected = kind == CONNECTED
            for listener in list(self._connection_listeners):
                listener(self.is_connected)

    def _refuse(self, reason: str) -> None:
        """Credentials the engine refuses: end every call at once instead of letting it wait forever."""
        self.refused = f"the engine at {self.address} refused this client's credentials ({reason})"
        if self._refusal is not None and not self._refusal.done():
            self._refusal.set_result(None)
        for stream in self._streams.values():
            stream.put(_Ended("forbidden", self.refused))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(ClientRefusedError(self.refused))

    async def _read_loop(self) -> None:
        while True:
            msg = await self._queue.get()
            if isinstance(msg, RequestDeltas):  # one step's deltas for this client's requests
                for delta in msg.deltas():
                    stream = self._streams.get(delta.request_id)
                    if stream is not None:
                        stream.put(delta)
            elif isinstance(msg, ErrorReply) and msg.request_id in self._streams:
                self._streams[msg.request_id].put(msg)
            elif isinstance(msg, _REPLIES) and msg.nonce in self._replies:
                fut = self._replies.pop(msg.nonce)
                if not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, ErrorReply):
                self.unrouted_errors.append(msg)

    async def generate(
        self,
        prompt: str | list[int] | list[dict[str, str]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream deltas (text, token ids, finish reason, logprobs) until the request finishes.

        `kv_transfer_params`: for the engine's KV connector (a disaggregated decode engine: where
        the prompt's KV is); the last delta carries the connector's own, if any."""
        self._ensure_reader()
        request_id = request_id or uuid.uuid4().hex
        if isinstance(sampling_params, SamplingParams):
            params = sampling_params.to_dict()
        else:
            params = dict(sampling_params or {})
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"duplicate request id {request_id!r}")
        stream = _Stream()
        self._streams[request_id] = stream
        finished = False
        try:
            msg = GenerateRequest(request_id, prompt, params, kv_transfer_params)
            try:
                await self._put(msg)
            except FrameTooLargeError as e:
                finished = True  # never sent
                field = _largest_field(msg)
                raise InvalidRequestError(field, f"the request is too large to send: {e}, most of it {field}") from e
            except (TypeError, ValueError, OverflowError) as e:  # msgpack cannot take a value (2**70, "\ud800")
                finished = True
                raise InvalidRequestError(_unpackable_field(msg), f"cannot be sent: {e}") from e
            while True:
                msg = await stream.get()
                if isinstance(msg, _Ended):  # `end_all`: finished stays False, so the engine hears of it
                    if msg.kind == "forbidden":
                        raise ClientRefusedError(msg.message)
                    if msg.kind == "engine_dead":
                        raise EngineDeadError(msg.message)
                    raise RequestFailedError(msg.kind, msg.message)
                if isinstance(msg, ErrorReply):
                    finished = True
                    raise _error_from(msg)
                finished = msg.finished
                yield msg
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the caller broke out or was cancelled: free it in the engine
                try:
                    await self._put(AbortRequest(request_id))
                except Exception:  # noqa: BLE001 - the socket may be closed already
                    pass

    async def abort(self, request_id: str) -> None:
        await self._put(AbortRequest(request_id))

    async def remote_prefill_done(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """A running request that awaits a remote prefill: that engine's params (its first token).
        A refusal ends the request's `generate` with an error."""
        await self._put(RemotePrefillDone(request_id, kv_transfer_params))

    def end_all(self, message: str, kind: str = "shutdown") -> None:
        """End every open `generate` with `RequestFailedError(kind, message)` (`EngineDeadError` for
        "engine_dead"), aborting its request in the engine (a server shutting down tells its own
        clients why)."""
        for stream in self._streams.values():
            stream.put(_Ended(kind, message))

    async def health(self, timeout_s: float = 5.0) -> bool:
        return (await self.health_reply(timeout_s)).is_healthy

    async def health_reply(self, timeout_s: float = 5.0) -> HealthReply:
        """Health, and the generation of the engine's KV connector (it goes up when its stages are restarted)."""
        return await self._call(HealthRequest, timeout_s)

    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        reply = await self._call(StatsRequest, timeout_s)
        return reply.stats

    async def kv_handshake(self, timeout_s: float = 5.0) -> EngineHandshake | None:
        """The engine's KV transfer endpoints (None: its connector publishes none); `RuntimeError`
        if the engine refuses (this client does not hold the engine role)."""
        reply = await self._call(KVHandshakeRequest, timeout_s)
        if reply.error is not None:
            raise RuntimeError(f"engine refused the KV handshake: {reply.error}")
        return reply.handshake

    async def add_remote_engine(self, handshake: EngineHandshake, timeout_s: float = 5.0) -> None:
        """Tell the engine's KV connector about a remote engine; raises `RuntimeError` if refused."""
        reply = await self._call(lambda nonce: AddRemoteEngine(nonce, handshake), timeout_s)
        if reply.error is not None:
            raise RuntimeError(f"engine refused remote engine {handshake.engine_id!r}: {reply.error}")

    async def _call(self, make: Callable[[int], Any], timeout_s: float) -> Any:
        self._ensure_reader()
        nonce = next(self._nonces)
        fut = asyncio.get_running_loop().create_future()
        self._replies[nonce] = fut  # before the send: the reply may come in while it waits
        try:
            await self._put(make(nonce))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(nonce, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # a refusal during the send failed it too: the send's error is the one raised

    def close(self) -> None:
        """Close the socket; an open `generate` ends with `RequestFailedError("closed", ...)`."""
        self.end_all("the client was closed", "closed")
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._queue.close()


class _Ended:
    """Put into a stream by `end_all`, never sent by an engine."""

    __slots__ = ("kind", "message")

    def __init__(self, kind: str, message: str) -> None:
        self.kind, self.message = kind, message


class _Stream:
    """One request's replies, in order, for its one reader: a deque and a future, lighter than
    `asyncio.Queue` (the reader is woken once per token, so this is on the client's hot path)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[RequestDelta | ErrorReply | _Ended] = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, msg: RequestDelta | ErrorReply | _Ended) -> None:
        self._items.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestDelta | ErrorReply | _Ended:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


def _error_from(msg: ErrorReply) -> Exception:
    # A frame the engine could not read is the request's own fault, like a bad value.
    if msg.kind in ("invalid_request", "bad_frame"):
        return InvalidRequestError(msg.field or "request", msg.message)
    if msg.kind == "engine_dead":
        return EngineDeadError(msg.message)
    return RequestFailedError(msg.kind, msg.message)


def _fields(msg: GenerateRequest) -> dict[str, Any]:
    """A request's parts by the names a caller knows them: sampling parameters by their own."""
    return {"prompt": msg.prompt, "kv_transfer_params": msg.kv_transfer_params, **msg.sampling_params}


def _largest_field(msg: GenerateRequest) -> str:
    """The part that takes the most of the request's frame."""
    sizes = {name: packed_size(value) for name, value in _fields(msg).items()}
    return max(sizes, key=sizes.__getitem__)


def _unpackable_field(msg: GenerateRequest) -> str:
    """The first part the codec cannot pack."""
    for name, value in _fields(msg).items():
        try:
            packed_size(value)
        except (TypeError, ValueError, OverflowError):
            return name
    return "request"
