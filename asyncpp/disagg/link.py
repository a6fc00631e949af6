"""`EngineLink`: the router's connection to one engine, and whether that engine is alive.

An engine killed outright answers nothing (ZMQ reconnects quietly and the
requests it held would wait forever), so the link asks for its health every
`health_interval_s`; no reply within `health_timeout_s`, a reply that says
unhealthy, or its process exiting (`mark_gone`, from whoever started it)
declares it dead and calls `on_dead` at once. A dead engine whose health
comes back (restarted at the same address) is alive again once `on_answer`
says so (the router re-exchanges the KV handshakes first); an engine whose
process is gone stays dead.

`exchange_handshakes` is the start-up step of prefill/decode: the prefill
engine's KV endpoints go to the decode engine, and the decode engine's (if it
publishes any) to the prefill engine, retried until both answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from asyncpp.client import AsyncClient
from asyncpp.logging import get_logger
from asyncpp.wire.client_auth import ENGINE

RETRY_INTERVAL_S = 0.2


class EngineLink:
    def __init__(
        self, role: str, address: str, *, engine_secret: str = "", health_interval_s: float = 0.5,
        health_timeout_s: float = 1.0, log_role: str = "pd_router",
    ) -> None:  # fmt: skip
        self.role = role  # "prefill" | "decode" | "replica N"
        self.address = address
        # In the engine role (the deployment's engine secret): the KV handshakes need it.
        self.client = AsyncClient(address, secret=engine_secret, role=ENGINE)
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.engine_id: str | None = None  # its KV handshake's, once exchanged (None: it publishes none)
        self.kv_generation = 0  # of the KV handshake last given to the other engine
        self.reported_generation = 0  # its health's: higher once its stages were restarted
        self.dead_reason: str | None = None  # None: alive
        self.is_gone = False  # its process exited: it never comes back
        self.on_dead: Callable[[EngineLink], None] = lambda link: None  # called once per death
        # A dead engine answers again: True if it may serve (the router re-exchanged handshakes).
        self.on_answer: Callable[[EngineLink], Awaitable[bool]] | None = None
        # Its stages were restarted (its health reports a new KV generation): handshakes are exchanged again.
        self.on_new_generation: Callable[[EngineLink], Awaitable[None]] | None = None
        self.log = get_logger(role=log_role, engine=role)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def name(self) -> str:
        return f"{self.role} engine ({self.address})"

    def dead_message(self) -> str:
        return f"{self.name} is dead: {self.dead_reason}"

    async def monitor(self) -> None:
        """Health checks until cancelled."""
        task = asyncio.current_task()
        while True:
            t0 = time.monotonic()
            reason = await self.check()
            if task is not None and task.cancelling():
                # Cancelled as the check timed out: Python 3.11's wait_for then raises TimeoutError and
                # the cancellation is lost; the router's close waited for this task forever.
                raise asyncio.CancelledError
            if reason is not None:
                self.mark_dead(reason)
            elif not self.is_alive and not self.is_gone and self.on_answer is not None:
                self.log.info("engine_answers_again", address=self.address)
                if await self.on_answer(self):
                    self.mark_alive()
            elif self.is_alive and self.reported_generation != self.kv_generation and self.on_new_generation is not None:
                await self.on_new_generation(self)
            await asyncio.sleep(max(0.0, self.health_interval_s - (time.monotonic() - t0)))

    async def check(self) -> str | None:
        """None if the engine answers healthy now, else why not."""
        try:
            reply = await self.client.health_reply(timeout_s=self.health_timeout_s)
        except TimeoutError:
            return f"no health reply within {self.health_timeout_s:g} s"
        self.reported_generation = reply.kv_generation
        return None if reply.is_healthy else "it reports itself unhealthy"

    def mark_dead(self, reason: str) -> None:
        if not self.is_alive:
            return
        self.dead_reason = reason
        self.log.error("engine_dead", address=self.address, reason=reason)
        self.on_dead(self)

    def mark_gone(self, reason: str) -> None:
        """Its process exited: dead for good."""
        self.is_gone = True
        if self.is_alive:
            self.mark_dead(reason)
        else:
            self.dead_reason = reason

    def mark_alive(self) -> None:
        self.dead_reason = None
        self.log.info("engine_alive", address=self.address)

    def close(self) -> None:
        self.client.close()


async def exchange_handshakes(prefill: EngineLink, decode: EngineLink, timeout_s: float) -> None:
    """Give each engine the other's KV handshake; retry while either does not answer.

    An engine that publishes none (no connector, or one that needs nothing of
    its peer) is skipped; one that published one before and has none now (its
    stages are being restarted) is waited for. An engine that refuses the other's handshake raises
    `RuntimeError`: the deployment is misconfigured, retrying will not help."""
    log = get_logger(role="pd_router")
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            per_call_s = max(0.1, min(1.0, remaining))
            handshakes = await asyncio.gather(
                prefill.client.kv_handshake(timeout_s=per_call_s), decode.client.kv_handshake(timeout_s=per_call_s)
            )
            for source, handshake in ((prefill, handshakes[0]), (decode, handshakes[1])):
                if handshake is None and source.engine_id is not None:
                    raise TimeoutError  # restarting its stages: their handshakes come once they are up
            for source, target, handshake in ((prefill, decode, handshakes[0]), (decode, prefill, handshakes[1])):
                source.engine_id = handshake.engine_id if handshake is not None else None
                if handshake is None:
                    log.info("no_kv_handshake", engine=source.role, address=source.address)
                    continue
                await target.client.add_remote_engine(handshake, timeout_s=per_call_s)
                source.kv_generation = handshake.generation
                log.info(
                    "kv_handshake_given", source=source.role, target=target.role, engine_id=handshake.engine_id,
                    generation=handshake.generation,
                )  # fmt: skip
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the prefill ({prefill.address}) and decode ({decode.address}) engines did not both answer "
                    f"within {timeout_s:g} s"
                ) from None
            await asyncio.sleep(RETRY_INTERVAL_S)
