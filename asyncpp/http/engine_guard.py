"""`EngineGuard`: the HTTP server serves one engine run, and answers 503 at once or soon when it cannot.

The engine is named by its run id (`stats()["run_id"]`): the launcher passes
its own (`--engine-id`); a server started by hand takes the run of the first
engine it reaches. ZMQ connects and reconnects to whatever listens at the
address, so each time a connection is made the run id is asked for before
any request is sent: another run there (a new engine, started after ours
died) is never served; the server refuses everything and stops (exit 1).

While no connection is up, the requests in flight end as `engine_dead` (no
reply can come: their engine is gone) and a new request waits up to `wait_s`
for the engine, then gets a 503. A server the launcher started
(`exits_when_lost`) stops as soon as the connection is lost: the run it was
started for cannot come back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncpp.client import AsyncClient, ClientRefusedError
from asyncpp.http.errors import unavailable
from asyncpp.logging import get_logger

CONNECTING, SERVING, LOST, FOREIGN = "connecting", "serving", "lost", "foreign"
ENGINE_WAIT_S = 5.0  # how long a request waits for an engine that is not reachable now
STATS_TIMEOUT_S = 5.0  # per try, asking a newly connected engine for its run id


class EngineGuard:
    def __init__(
        self, client: AsyncClient, engine_id: str | None, *, wait_s: float = ENGINE_WAIT_S,
        exits_when_lost: bool = False, on_fatal: Callable[[str], None] = lambda reason: None,
    ) -> None:  # fmt: skip
        self.client = client
        self.engine_id = engine_id  # None: the first engine reached
        self.wait_s = wait_s
        self.exits_when_lost = exits_when_lost
        self.on_fatal = on_fatal  # the server stops: its engine is gone for good
        self.state = CONNECTING
        self.reason = f"no engine reached at {client.address} yet"  # why not SERVING
        self._changed = asyncio.Event()  # replaced at each change of state: waiters wake
        self._verifying: asyncio.Task | None = None
        self.log = get_logger(role="http")

    @property
    def is_serving(self) -> bool:
        return self.state == SERVING

    def start(self) -> None:
        """Watch the client's connection (in the running loop)."""
        self.client.on_connection(self._on_connection)

    def close(self) -> None:
        if self._verifying is not None:
            self._verifying.cancel()

    async def serves_within(self, timeout_s: float) -> bool:
        """Whether the engine may be sent requests, now or within `timeout_s` (one being checked)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.state != SERVING:
            remaining = deadline - asyncio.get_running_loop().time()
            if self.state == FOREIGN or self.client.refused is not None or remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    async def admit(self) -> None:
        """Return once a request may go to the engine; a 503 if it cannot within `wait_s`."""
        if await self.serves_within(self.wait_s):
            return
        if self.client.refused is not None:  # our credentials: no wait makes them right
            raise unavailable(self.client.refused, "engine_unavailable")
        raise unavailable(self.reason, "engine_unavailable" if self.state == CONNECTING else "engine_dead")

    def _on_connection(self, is_connected: bool) -> None:
        if self.state == FOREIGN:
            return
        self.close()
        if is_connected:
            self._verifying = asyncio.get_running_loop().create_task(self._verify())
            return
        if self.state == CONNECTING:  # a connection whose run was not known yet
            return
        self._set(LOST, f"the connection to the engine at {self.client.address} was lost")
        self.log.warning("engine_connection_lost", address=self.client.address, run_id=self.engine_id)
        self.client.end_all(self.reason, "engine_dead")
        if self.exits_when_lost:
            self.on_fatal(self.reason)

    async def _verify(self) -> None:
        """Ask the engine just connected to for its run id; serve it only if it is ours."""
        while True:
            try:
                run_id = (await self.client.stats(timeout_s=STATS_TIMEOUT_S)).get("run_id")
                break
            except TimeoutError:
                self.log.warning("engine_stats_timeout", address=self.client.address, timeout_s=STATS_TIMEOUT_S)
            except ClientRefusedError as e:  # requests get a 503 naming it (`admit`)
                self.log.error("engine_refused_client", address=self.client.address, error=str(e))
                self._set(self.state, str(e))
                return
        if self.engine_id is None:
            self.engine_id = run_id
        if run_id is None or run_id != self.engine_id:
            self._set(FOREIGN, f"the engine at {self.client.address} is run {run_id!r}, not {self.engine_id!r}, "
                               "which this server was started for")  # fmt: skip
            self.log.error("engine_mismatch", address=self.client.address, run_id=run_id, expected=self.engine_id)
            self.client.end_all(self.reason, "engine_dead")
            self.on_fatal(self.reason)
            return
        self._set(SERVING, "")
        self.log.info("engine_connected", address=self.client.address, run_id=run_id)

    def _set(self, state: str, reason: str) -> None:
        self.state, self.reason = state, reason
        self._changed.set()
        self._changed = asyncio.Event()
