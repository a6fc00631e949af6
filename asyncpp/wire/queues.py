"""Tiny queue classes around ZMQ sockets; with `loop_socket`, the only place that imports `zmq`.

Stages use the blocking `PushQueue` / `PullQueue`; the engine and clients use
the asyncio variants, which drive plain sockets through `LoopSocket`. Every
frame is encoded by `asyncpp.wire.codec`. `RouterQueue` (engine, one socket
for all clients) hands back the peer id with each message or the `WireError`
that frame raised, so one bad client never disturbs the others. `DealerQueue`
(client) refuses to send a frame over its limit (`FrameTooLargeError`): ZMQ
would drop the connection for one over the hard limit without a word.
"""

from __future__ import annotations

from typing import Any

import zmq

from asyncpp.wire.codec import WireError, decode, encode
from asyncpp.wire.token_auth import secure_socket
from asyncpp.wire.loop_socket import LoopSocket

# ZMQ drops a peer whose frame exceeds this; the logical limit below answers with an error first.
_HARD_MAX_FRAME_BYTES = 256 * 1024 * 1024


class FrameTooLargeError(ValueError):
    """A message whose frame is over the limit of the socket it was for; it was not sent."""

    def __init__(self, num_bytes: int, max_bytes: int) -> None:
        super().__init__(f"a frame of {num_bytes} bytes is over the {max_bytes}-byte limit")
        self.num_bytes, self.max_bytes = num_bytes, max_bytes


def _socket(ctx: zmq.Context, kind: int, address: str, bind: bool, token: str | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    if token is not None:  # a control channel across hosts: only the run's own peers (`token_auth`)
        secure_socket(sock, token, bind, address)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, _HARD_MAX_FRAME_BYTES)
    if kind in (zmq.PUSH, zmq.DEALER, zmq.ROUTER):
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind in (zmq.PULL, zmq.DEALER, zmq.ROUTER):
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class PushQueue:
    def __init__(self, address: str, bind: bool = False, token: str | None = None) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = _socket(self._ctx, zmq.PUSH, address, bind, token)

    def put(self, msg: Any) -> None:
        self._sock.send(encode(msg), copy=False)

    @property
    def address(self) -> str:
        """The bound (or connected) endpoint, with the port the OS chose for port 0."""
        return self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def close(self) -> None:
        self._sock.close(linger=0)


class PullQueue:
    def __init__(self, address: str, bind: bool = False, token: str | None = None) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = _socket(self._ctx, zmq.PULL, address, bind, token)

    def get(self, timeout_s: float | None = None) -> Any:
        """Next message; `TimeoutError` if none arrives within `timeout_s`."""
        if timeout_s is not None and not self._sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no message within {timeout_s} s")
        return decode(self._sock.recv(copy=True))

    def has_message(self) -> bool:
        return bool(self._sock.poll(0))

    @property
    def address(self) -> str:
        """The bound (or connected) endpoint, with the port the OS chose for port 0."""
        return self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncPushQueue:
    def __init__(self, address: str, bind: bool = False, token: str | None = None) -> None:
        self._io = LoopSocket(_socket(zmq.Context.instance(), zmq.PUSH, address, bind, token))

    async def put(self, msg: Any) -> None:
        await self._io.send(encode(msg))

    async def put_encoded(self, frame: bytes) -> None:
        """Send a frame made by `asyncpp.wire.codec.encode` (a broadcast encodes once)."""
        await self._io.send(frame)

    @property
    def address(self) -> str:
        """The bound (or connected) endpoint, with the port the OS chose for port 0."""
        return self._io.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def close(self) -> None:
        self._io.close()


class AsyncPullQueue:
    def __init__(self, address: str, bind: bool = False, token: str | None = None) -> None:
        self._io = LoopSocket(_socket(zmq.Context.instance(), zmq.PULL, address, bind, token))

    async def get(self) -> Any:
        return decode(await self._io.recv())

    @property
    def address(self) -> str:
        """The bound (or connected) endpoint, with the port the OS chose for port 0."""
        return self._io.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def close(self) -> None:
        self._io.close()


class PeerGoneError(ConnectionError):
    """The client this message was for has disconnected."""


class RouterQueue:
    """Engine side of the client channel: many peers on one bound socket."""

    def __init__(self, address: str, max_frame_bytes: int) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        # Sending to a disconnected peer raises instead of dropping silently: that is
        # how the engine learns a client went away and aborts its requests.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _HARD_MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        self._io = LoopSocket(sock)
        self.max_frame_bytes = max_frame_bytes

    @property
    def address(self) -> str:
        return self._io.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def get(self) -> tuple[bytes, Any]:
        """(peer id, message), or (peer id, WireError) for a frame that did not decode."""
        frames = await self._io.recv_multipart()
        peer, payload = frames[0], frames[-1]
        if len(frames) != 2:
            return peer, WireError(f"expected one frame per message, got {len(frames) - 1}")
        try:
            return peer, decode(payload, self.max_frame_bytes)
        except WireError as e:
            return peer, e

    async def put(self, peer: bytes, msg: Any) -> None:
        try:
            await self._io.send_multipart([peer, encode(msg)])
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerGoneError(f"client {peer.hex()} is gone") from e
            raise

    def close(self) -> None:
        self._io.close()


class DealerQueue:
    """Client side of the client channel; `max_frame_bytes`: the engine's limit, if known."""

    def __init__(self, address: str, max_frame_bytes: int | None = None) -> None:
        self._sock = _socket(zmq.Context.instance(), zmq.DEALER, address, bind=False)
        self._io = LoopSocket(self._sock)
        self.max_frame_bytes = min(max_frame_bytes or _HARD_MAX_FRAME_BYTES, _HARD_MAX_FRAME_BYTES)

    async def put(self, msg: Any) -> None:
        frame = encode(msg)
        if len(frame) > self.max_frame_bytes:
            raise FrameTooLargeError(len(frame), self.max_frame_bytes)
        await self._io.send(frame)

    async def put_raw(self, payload: bytes) -> None:
        """Send bytes as they are (tests use it to send malformed frames)."""
        await self._io.send(payload)

    async def get(self) -> Any:
        return decode(await self._io.recv())

    def close(self) -> None:
        self._io.close()
