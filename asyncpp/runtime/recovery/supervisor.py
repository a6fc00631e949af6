"""`PipelineSupervisor`: watch the stages; when one is lost, restart them in place and resume.

A stage is lost when its process exits (killed, crashed, out of memory) or
when it passes the step deadline (`parallel.step_timeout_s`: hung). Then, one
structured event per phase:
1. `stage_lost`: the step window stops dispatching and forgets the steps in
   flight (never applied: no token of theirs reached a client); every stage
   process is killed (`StageGroup.kill_all`, which also fails a plan's send
   still waiting on a dead stage), and the output loop stops at its read
   (`park_outputs`), so no step is half-completed;
2. `recovery_requeued`: every running request goes back to the queue with the
   tokens it has delivered, to be computed again (`Scheduler.recompute_all`);
3. `stages_restarted`: new stage processes with the same arguments go through
   start-up again (`StageGroup.start_again`). The survivors were replaced too:
   their KV is recomputed anyway, and one may be blocked for good on the lost
   stage's ring or queue;
4. `stage_recovered`: the window resumes; requests arriving or aborted
   meanwhile were queued or freed as usual (the new stages never saw them).
A new stage that dies or is late during start-up counts as another restart.
Restarts are bounded by a `RestartBudget` (`parallel.max_stage_restarts` within
`parallel.restart_window_s`); past it, or where a restart cannot keep its
promise (a KV connector that cannot forget the transfers in flight, such as
prefill/decode disaggregation's; the Ray backend does not restart actors yet), `on_dead` fails every request and stops
the engine, as without restarts.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asyncpp.engine.startup import set_stage_handshakes
from asyncpp.logging import get_logger
from asyncpp.runtime.recovery.budget import RestartBudget
from asyncpp.runtime.stage_group import StageDiedError, StageGroup
from asyncpp.runtime.step_window import StepWindow

# (lost ranks, "exited" | "hung", seconds the hung stage waited or None, why it was not restarted)
OnDead = Callable[[list[int], str, "float | None", str], Awaitable[None]]
MAX_RECOVERY_TIMES = 1000  # recent recovery times kept for stats


class PipelineSupervisor:
    def __init__(
        self,
        core: Any,
        stages: StageGroup,
        window: StepWindow,
        *,
        budget: RestartBudget,
        start_timeout_s: float,
        park_outputs: Callable[[], Awaitable[None]],
        unpark_outputs: Callable[[], None],
        on_dead: OnDead,
    ) -> None:
        self.core = core  # `EngineCore`: its scheduler requeues the requests
        self.stages = stages
        self.window = window
        self.budget = budget
        self.start_timeout_s = start_timeout_s
        self.park_outputs = park_outputs
        self.unpark_outputs = unpark_outputs
        self.on_dead = on_dead
        self.num_restarts = 0  # attempts, failed ones included
        self.recovery_s: collections.deque[float] = collections.deque(maxlen=MAX_RECOVERY_TIMES)
        self.log = get_logger(role="engine", pp_rank=None)

    async def run(self) -> None:
        """Until the engine is declared dead: wait for a loss, recover from it."""
        while True:
            lost, cause, waited_s = await self._wait_for_loss()
            if self.window.is_stopped or not await self._recover(lost, cause, waited_s):
                return

    async def _wait_for_loss(self) -> tuple[list[int], str, float | None]:
        """The first of: a stage process exits, a stage passes the step deadline."""
        death = asyncio.ensure_future(self.stages.wait_for_death())
        hang = asyncio.ensure_future(self.window.wait_for_hang())
        try:
            await asyncio.wait({death, hang}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (death, hang):
                task.cancel()
            await asyncio.gather(death, hang, return_exceptions=True)
        if death.done() and not death.cancelled() and death.exception() is None:
            return death.result(), "exited", None
        hung, waited_s = hang.result()
        return hung, "hung", waited_s

    def _refusal(self, now: float) -> str | None:
        """Why the stages may not be restarted now; None if they may (a restart is then counted)."""
        if not self.stages.supports_restart:
            return "this backend does not restart stages"
        if not self.core.scheduler.can_recompute_all:
            return "its KV connector cannot forget the transfers that die with the stages"
        if self.budget.max_restarts == 0:
            return "restarts are off (parallel.max_stage_restarts = 0)"
        if not self.budget.take(now):
            return (
                f"{self.budget.max_restarts} restarts within parallel.restart_window_s = {self.budget.window_s:g} s "
                "already (parallel.max_stage_restarts)"
            )
        return None

    async def _recover(self, lost: list[int], cause: str, waited_s: float | None) -> bool:
        """Restart the stages and resume; False once the engine was declared dead instead."""
        t0 = time.monotonic()
        scheduler = self.core.scheduler
        if (why := self._refusal(t0)) is not None:
            await self.on_dead(lost, cause, waited_s, why)
            return False
        self.log.warning(
            "stage_lost", pp_ranks=lost, cause=cause, waited_s=None if waited_s is None else round(waited_s, 3),
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting, restart=self.num_restarts + 1,
        )  # fmt: skip
        num_steps = self.window.pause()
        await self.stages.kill_all()  # also fails a plan's send that waits on a dead stage
        await self.park_outputs()
        recompute = scheduler.recompute_all()
        self.log.info(
            "recovery_requeued", num_requests=recompute.num_requests, num_tokens=recompute.num_tokens,
            num_discarded_steps=num_steps,
        )  # fmt: skip
        while True:
            self.num_restarts += 1
            t_start = time.monotonic()
            try:
                handshakes = await self.stages.start_again(self.start_timeout_s)
                if handshakes is not None and scheduler.connector is not None:
                    set_stage_handshakes(scheduler.connector, handshakes)  # the new stages' KV memory
                break
            except (StageDiedError, TimeoutError) as e:
                self.log.error("stage_restart_failed", error=str(e), restart=self.num_restarts)
                if (why := self._refusal(time.monotonic())) is not None:
                    await self.on_dead(lost, cause, waited_s, f"a restart failed ({e}), and {why}")
                    return False
                await self.stages.kill_all()
        self.log.info(
            "stages_restarted", stage_pids=[p.pid for p in self.stages.procs], start_s=round(time.monotonic() - t_start, 3),
            incarnation=self.stages.incarnation,
        )  # fmt: skip
        self.window.resume()
        self.unpark_outputs()
        recovery_s = time.monotonic() - t0
        self.recovery_s.append(recovery_s)
        self.log.warning("stage_recovered", recovery_s=round(recovery_s, 3), restarts=self.num_restarts)
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "stage_restarts": self.num_restarts,
            "stage_recovery_s": list(self.recovery_s),
            "stage_start_s": list(getattr(self.stages, "start_s", [])),  # the first start, then each restart
            "num_recomputed_requests": self.core.scheduler.num_recomputed_requests,
            "num_recomputed_tokens": self.core.scheduler.num_recomputed_tokens,
        }
