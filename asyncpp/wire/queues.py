"""Tiny queue classes around ZMQ sockets; with `loop_socket`, the only place that imports `zmq`.

Stages use the blocking `PushQueue` / `PullQueue`; the engine and clients use
the asyncio variants, which drive plain sockets through `LoopSocket`. Every
frame is encoded by `asyncpp.wire.codec`. `RouterQueue` (engine, one socket
for all clients) hands back the peer id with each message or the `WireError`
that frame raised, so one bad client never disturbs the others. `DealerQueue`
(client) refuses to send a frame over its limit (`FrameTooLargeError`): ZMQ
would drop the connection for one over the hard limit without a word. The
client channel always speaks PLAIN: `RouterQueue` lets peers in and tells
their role as `wire.client_auth` decides, `DealerQueue` presents its own.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from asyncpp.wire.client_auth import CLIENT, ClientAccess
from asyncpp.wire.codec import WireError, decode, encode
from asyncpp.wire.token_auth import (
    REFUSAL_EVENTS,
    forget_plain,
    monitor_address,
    refusal_reason,
    require_plain,
    secure_socket,
)
from asyncpp.wire.loop_socket import LoopSocket

# What `DealerQueue.next_event` reports about its connection to the engine.
CONNECTED, DISCONNECTED, REFUSED = "connected", "disconnected", "refused"
_CONNECTION_EVENTS = REFUSAL_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

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
    return _configured(sock, address, bind)


def _configured(sock: zmq.Socket, address: str, bind: bool) -> zmq.Socket:
    kind = sock.type
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
    """Engine side of the client channel: many peers on one bound socket, each in its role; an
    address it cannot bind is an `OSError` with the OS's errno (`EADDRINUSE`: the port is taken)."""

    def __init__(self, address: str, max_frame_bytes: int, access: ClientAccess = ClientAccess()) -> None:
        access.check_bind(address)
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        # Sending to a disconnected peer raises instead of dropping silently: that is
        # how the engine learns a client went away and aborts its requests.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _HARD_MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        self._domain = ClientAccess.new_domain()
        require_plain(sock, self._domain, access.allows, address)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:  # a port in use, an address not this machine's: as the OS says it
            sock.close(linger=0)
            forget_plain(self._domain)
            raise OSError(e.errno, f"cannot bind {address}: {e.strerror}") from None
        self._io = LoopSocket(sock)
        self.max_frame_bytes = max_frame_bytes

    @property
    def address(self) -> str:
        return self._io.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def get(self) -> tuple[bytes, Any]:
        """(peer id, message), or (peer id, WireError) for a frame that did not decode."""
        peer, _, msg = await self.get_with_role()
        return peer, msg

    async def get_with_role(self) -> tuple[bytes, str, Any]:
        """(peer id, its role, message or WireError); the role is what its credentials let it in as."""
        frames = await self._io.recv_multipart(copy=False)
        peer, payload = frames[0].bytes, frames[-1]
        role = payload.get("User-Id")
        if len(frames) != 2:
            return peer, role, WireError(f"expected one frame per message, got {len(frames) - 1}")
        try:
            return peer, role, decode(payload.bytes, self.max_frame_bytes)
        except WireError as e:
            return peer, role, e

    async def put(self, peer: bytes, msg: Any) -> None:
        try:
            await self._io.send_multipart([peer, encode(msg)])
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerGoneError(f"client {peer.hex()} is gone") from e
            raise

    def close(self) -> None:
        self._io.close()
        forget_plain(self._domain)


class DealerQueue:
    """Client side of the client channel; `max_frame_bytes`: the engine's limit, if known; `role`
    and `secret`: what it presents (`wire.client_auth`)."""

    def __init__(
        self, address: str, max_frame_bytes: int | None = None, role: str = CLIENT, secret: str = "",
        watch_connection: bool = False,
    ) -> None:  # fmt: skip
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.plain_username = role.encode()
        sock.plain_password = (secret or "none").encode()  # PLAIN takes no empty password
        # Before connecting: a refusal of our credentials is seen on the monitor, never as a frame,
        # and with `watch_connection` so is the connection made or lost (ZMQ reconnects without a
        # word). Only then: ZMQ's I/O thread sends a socket's monitor events, blocking while the
        # monitor's reader is not there, so a socket with them whose monitor closed (or was never
        # read) can stall every connection of the process. Its owner must read `next_event` always.
        events = _CONNECTION_EVENTS if watch_connection else REFUSAL_EVENTS
        self._monitor = LoopSocket(sock.get_monitor_socket(events, monitor_address()))
        self._sock = _configured(sock, address, bind=False)
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

    async def next_event(self) -> tuple[str, str]:
        """The next change of this socket's connection: (CONNECTED, "") once a handshake with the
        engine succeeded, (DISCONNECTED, "") once that connection is lost (ZMQ reconnects, perhaps
        to another process at the address), (REFUSED, why) once the engine refused our credentials."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event & REFUSAL_EVENTS:  # (not the monitor's own stop)
                return REFUSED, refusal_reason(event)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return CONNECTED, ""
            if event == zmq.EVENT_DISCONNECTED:
                return DISCONNECTED, ""

    async def refused(self) -> str:
        """Wait until the engine refuses this socket's credentials; why (the engine's port lets no
        frame of ours in, so the caller must not wait for replies after this)."""
        while True:
            kind, reason = await self.next_event()
            if kind == REFUSED:
                return reason

    def close(self) -> None:
        # The monitor first detached from the socket, then both closed: a socket closed with its
        # monitor attached (its DISCONNECTED event on the way) can leave ZMQ's I/O thread stuck,
        # and with it every connection this process makes afterwards.
        self._sock.disable_monitor()
        self._monitor.close()
        self._io.close()
