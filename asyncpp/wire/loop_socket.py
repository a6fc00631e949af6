"""`LoopSocket`: drive a plain ZMQ socket from an asyncio loop with little overhead.

pyzmq's `zmq.asyncio` sockets wrap every send and receive in futures, flag
enums and handler updates; on the engine, which sends and receives a few
frames per step, that was a large share of its CPU. Here each call first
tries the non-blocking operation and only waits when ZMQ answers "again".

ZMQ's file descriptor is edge-triggered and shared by both directions: it
signals "the socket's state may have changed", and only reading `EVENTS`
(or a send / recv, which process the same internal commands) re-arms it.
Hence:
* a caller reads `EVENTS` before it sleeps, so it never sleeps on a message
  that is already queued;
* one reader callback per socket reads `EVENTS` (re-arming the FD, so the
  level-triggered loop does not spin on it) and wakes the waiters whose
  event is now possible; they retry their operation;
* a send or receive may swallow the signal another waiter sleeps on, so
  after each one the waiters are checked the same way.
A socket is used from one loop at a time; moving to another loop (a new
`asyncio.run`) moves the reader with it.
"""

from __future__ import annotations

import asyncio

import zmq

# Plain ints: pyzmq's constants are enums, and `events & zmq.POLLIN` runs Python-level Flag code.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)


class SocketClosedError(ConnectionError):
    """The socket was closed while this call waited on it."""


class LoopSocket:
    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[int, asyncio.Future]] = []  # (POLLIN or POLLOUT, woken when possible)

    async def send(self, frame: bytes) -> None:
        while True:
            try:  # sends almost never wait (no high-water mark): just try
                self.sock.send(frame, _NOBLOCK, copy=False)
                break
            except zmq.Again:
                await self._wait(_POLLOUT)
        self._recheck()

    async def send_multipart(self, frames: list[bytes]) -> None:
        while True:
            try:
                self.sock.send_multipart(frames, _NOBLOCK, copy=False)
                break
            except zmq.Again:
                await self._wait(_POLLOUT)
        self._recheck()

    async def recv(self) -> bytes:
        # Receives usually do wait: asking EVENTS first is cheaper than a recv raising "again".
        is_ready = self.sock.getsockopt(_EVENTS) & _POLLIN
        while True:
            if not is_ready:
                await self._sleep(_POLLIN)
            try:
                frame = self.sock.recv(_NOBLOCK, copy=True)
                break
            except zmq.Again:  # taken in between: wait again
                is_ready = False
        self._recheck()
        return frame

    async def recv_multipart(self, copy: bool = True) -> list:
        """Bytes, or with `copy` False `zmq.Frame`s (which carry the peer's properties)."""
        is_ready = self.sock.getsockopt(_EVENTS) & _POLLIN
        while True:
            if not is_ready:
                await self._sleep(_POLLIN)
            try:
                frames = self.sock.recv_multipart(_NOBLOCK, copy=copy)
                break
            except zmq.Again:
                is_ready = False
        self._recheck()
        return frames

    def close(self) -> None:
        """Close the socket; a send or receive waiting on it raises `SocketClosedError`."""
        waiters = self._waiters
        self._detach()
        self.sock.close(linger=0)
        for _, waiter in waiters:
            if not waiter.done():
                waiter.set_exception(SocketClosedError("socket closed"))

    async def _wait(self, event: int) -> None:
        if not self.sock.getsockopt(_EVENTS) & event:
            await self._sleep(event)

    async def _sleep(self, event: int) -> None:
        """Return once `EVENTS` has shown `event` (it may be gone again by then: callers retry)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._detach()
            loop.add_reader(self._fd, self._wake_ready)
            self._loop = loop
        waiter = loop.create_future()
        self._waiters.append((event, waiter))
        await waiter

    def _recheck(self) -> None:
        """After our own send / recv: it may have taken the signal someone else sleeps on."""
        if self._waiters:
            self._wake_ready()

    def _wake_ready(self) -> None:
        # Reading EVENTS re-arms the FD: also needed when nobody waits, or the loop spins on it.
        events = self.sock.getsockopt(_EVENTS)
        if not self._waiters:
            return
        waiting = []
        for event, waiter in self._waiters:
            if waiter.done():  # cancelled
                continue
            if events & event:
                waiter.set_result(None)
            else:
                waiting.append((event, waiter))
        self._waiters = waiting

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None
        self._waiters = []
