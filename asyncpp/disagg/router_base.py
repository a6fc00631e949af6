"""`RouterBase`: what every router in front of engines shares (prefill/decode, data parallel).

A router speaks the engine's client protocol on its client port
(`ClientFront`) and keeps one task per client request (`Routed`), known by
(client, request id); each engine sees the request under an id the router
makes (`<client id>.<tag><router id>.<n>`): two clients may use the same id,
and the router id (64 random bits drawn when the router starts) keeps a
second router in front of the same engines, or this one restarted (whose `n`
starts over), from making an id a live request already has. Here: the
request ids and the checks every new request gets, abort (cancelling the
task closes its engine stream, which aborts it there), a client gone, failing
a request once, draining, health and the KV-handshake questions a router
answers for itself. Each subclass routes (`add_request`, its `_route` tasks)
and says when it is healthy.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from asyncpp.disagg.front import ClientFront
from asyncpp.disagg.link import EngineLink
from asyncpp.disagg.translate import invalid
from asyncpp.logging import get_logger
from asyncpp.wire.client_msgs import (
    AddRemoteEngine,
    AddRemoteEngineReply,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    KVHandshakeReply,
    KVHandshakeRequest,
    StatsReply,
    StatsRequest,
)
from asyncpp.wire.queues import RouterQueue

STATS_TIMEOUT_S = 1.0  # per engine, asked at once; the HTTP front end gives the router 2 s


@dataclass(eq=False)
class Routed:
    """A client's request in a router."""

    peer: bytes
    msg: GenerateRequest  # as the client sent it
    engine_request_id: str  # its id on the engines
    task: asyncio.Task | None = field(default=None, repr=False, kw_only=True)

    @property
    def key(self) -> tuple[bytes, str]:
        return self.peer, self.msg.request_id

    def log_context(self) -> dict[str, Any]:
        """Where it is, for its log events."""
        return {}


class RouterBase:
    log_role = "router"
    id_tag = "r"  # in engine request ids
    no_remote_engines = "a router has no KV connector: tell its engines"

    def __init__(self, queue: RouterQueue, links: list[EngineLink], counters: Any) -> None:
        self.links = links
        replies = {
            HealthRequest: self._health,
            StatsRequest: self._stats,
            KVHandshakeRequest: self._kv_handshake,
            AddRemoteEngine: self._add_remote_engine,
        }
        self.front = ClientFront(queue, self, replies, log_role=self.log_role)
        self.requests: dict[tuple[bytes, str], Any] = {}  # a `Routed` each
        self.counters = counters  # num_requests, num_finished, num_aborted, num_failed at least
        self.is_draining = False
        self.router_id = secrets.token_hex(8)  # in every engine request id: unique across routers and restarts
        self._ids = itertools.count(1)
        self._stop = asyncio.Event()
        self.log = get_logger(role=self.log_role, router_id=self.router_id)

    @property
    def address(self) -> str:
        return self.front.queue.address

    @property
    def is_healthy(self) -> bool:
        raise NotImplementedError

    def engine_request_id(self, request_id: str) -> str:
        return f"{request_id}.{self.id_tag}{self.router_id}.{next(self._ids)}"

    # ---- lifecycle -------------------------------------------------------------------------
    async def serve(self) -> None:
        """Clients and the engines' health checks, until `drain_and_stop`."""
        tasks = [asyncio.create_task(self.front.serve(), name=f"{self.log_role}_clients")]
        tasks += [asyncio.create_task(link.monitor(), name=f"{link.role}_health") for link in self.links]
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def drain_and_stop(self, grace_period_s: float) -> None:
        """Refuse new requests, let running ones finish within the grace period, fail the rest."""
        if self.is_draining:
            return
        self.is_draining = True
        self.log.info("router_draining", num_unfinished=len(self.requests), grace_period_s=grace_period_s)
        deadline = time.monotonic() + grace_period_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tasks = [req.task for req in self.requests.values() if req.task is not None]
        for req in list(self.requests.values()):
            self._fail(req, "the router shut down before the request finished", "shutdown")
        if tasks:  # cancelled: let their aborts reach the engines
            await asyncio.wait(tasks, timeout=1.0)
        self._stop.set()

    async def close(self) -> None:
        await self.front.close()
        for link in self.links:
            link.close()

    # ---- requests (`RouterSink`) -----------------------------------------------------------
    def refusal(self, peer: bytes, msg: GenerateRequest) -> ErrorReply | None:
        """The error a new request gets whatever the router: draining, a bad or duplicate id."""
        rid = msg.request_id
        if self.is_draining:
            return ErrorReply(rid, "the router is shutting down", "shutdown")
        if not isinstance(rid, str) or not rid:
            return invalid(rid, "request_id", "must be a non-empty string")
        if (peer, rid) in self.requests:
            return invalid(rid, "request_id", f"duplicate request id {rid!r}")
        return None

    def start(self, req: Routed, route: Any) -> None:
        """Take `req` and run the coroutine `route` as its task."""
        self.requests[req.key] = req
        self.counters.num_requests += 1
        req.task = asyncio.get_running_loop().create_task(route)

    def abort(self, peer: bytes, request_id: str) -> None:
        req = self.requests.get((peer, request_id))
        if req is not None:
            self._forget(req)
            self.counters.num_aborted += 1
            self.log.debug("request_aborted", request_id=req.engine_request_id, **req.log_context())
            req.task.cancel()  # closing its engine stream aborts it there

    def is_live(self, peer: bytes, request_id: str) -> bool:
        return (peer, request_id) in self.requests

    def drop_peer(self, peer: bytes) -> None:
        gone = [key for key in self.requests if key[0] == peer]
        for _, request_id in gone:
            self.abort(peer, request_id)
        if gone:
            self.log.info("client_gone", peer=peer.hex(), num_aborted=len(gone))

    def _forget(self, req: Routed) -> None:
        """`req` is over (finished, aborted or failed): a late abort finds nothing."""
        del self.requests[req.key]

    def _finished(self, req: Routed) -> None:
        if self.requests.get(req.key) is req:
            self._forget(req)
            self.counters.num_finished += 1

    def _fail(self, req: Routed, message: str, kind: str, error_field: str | None = None) -> None:
        """End the request with an error for its client (once) and stop its task."""
        if self.requests.get(req.key) is not req:
            return  # finished, aborted or failed already
        self._forget(req)
        self.counters.num_failed += 1
        self.log.info("request_failed", request_id=req.engine_request_id, kind=kind, error=message, **req.log_context())
        if req.task is not None and req.task is not asyncio.current_task():
            req.task.cancel()
        self.front.push_error(req.peer, ErrorReply(req.msg.request_id, message, kind, error_field))

    # ---- request/reply ---------------------------------------------------------------------
    async def _health(self, msg: HealthRequest) -> HealthReply:
        return HealthReply(msg.nonce, self.is_healthy)

    async def _stats(self, msg: StatsRequest) -> StatsReply:
        raise NotImplementedError

    async def _kv_handshake(self, msg: KVHandshakeRequest) -> KVHandshakeReply:
        return KVHandshakeReply(msg.nonce, None)

    async def _add_remote_engine(self, msg: AddRemoteEngine) -> AddRemoteEngineReply:
        return AddRemoteEngineReply(msg.nonce, self.no_remote_engines)


async def engine_stats(link: EngineLink) -> dict[str, Any] | None:
    """The engine's stats, or None if it is dead or does not answer within `STATS_TIMEOUT_S`."""
    if not link.is_alive:
        return None
    try:
        return await link.client.stats(timeout_s=STATS_TIMEOUT_S)
    except TimeoutError:
        return None
