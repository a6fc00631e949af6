"""`EngineServer`: the engine process's asyncio loop over the pipeline stages.

It composes the engine's tasks on one loop, none of which blocks it:
* clients (`ClientPort`): decode and validate requests (and the remote prefills
  that requests awaited), route deltas and errors; KV handshakes only to the
  engine role;
* the step window (`StepWindow`): schedule, dispatch and complete steps across
  the stages, KV-transfer polling included;
* the supervisor (`asyncpp.runtime.recovery`): sleep until a stage process
  exits, or until a stage passes the step deadline (`parallel.step_timeout_s`:
  hung), then restart the stages in place and let every request finish;
  past `parallel.max_stage_restarts` (or where a restart is not possible),
  fail every request with an engine-dead error, turn `/health` false and
  stop (exit code 1).
What is left here is what ties them together: taking a request into the
engine core (huge prompts are tokenized off the loop), aborts, failing a
request with a message for its client, draining on shutdown, and `stats()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

from asyncpp.core.request import RequestStatus
from asyncpp.engine.compute_plan import ComputePlan, compute_stats
from asyncpp.engine.engine import EngineCore
from asyncpp.engine.input_processor import tokenizes_off_loop
from asyncpp.engine.layer_balance import LayerBalancer
from asyncpp.errors import InvalidRequestError
from asyncpp.logging import get_logger
from asyncpp.runtime.client_port import ClientPort, RequestRefused
from asyncpp.runtime.recovery import PipelineSupervisor, RestartBudget
from asyncpp.runtime.stage_group import StageGroup
from asyncpp.runtime.step_window import StepWindow
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_msgs import (
    AddRemoteEngine,
    AddRemoteEngineReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    KVHandshakeReply,
    KVHandshakeRequest,
    RemotePrefillDone,
    StatsReply,
    StatsRequest,
)
from asyncpp.wire.queues import RouterQueue

STAGE_START_TIMEOUT_S = 120.0  # a restarted stage's start-up (load, ready, handshake), as the first one's


class EngineServer:
    def __init__(
        self,
        core: EngineCore,
        stages: StageGroup,
        router: RouterQueue,
        *,
        max_cohorts: int | None = None,
        async_scheduling: bool = False,
        grace_period_s: float = 5.0,
        compute_plan: ComputePlan | None = None,
        balancer: LayerBalancer | None = None,
    ) -> None:
        self.core = core
        self.stages = stages
        self.router = router
        self.pp_size = stages.pp_size
        self.grace_period_s = grace_period_s
        self.compute_plan = compute_plan  # what the stages compute with, for stats
        replies = {
            HealthRequest: self._health,
            StatsRequest: self._stats_reply,
            KVHandshakeRequest: self._kv_handshake,
            AddRemoteEngine: self._add_remote_engine,
        }
        self.port = ClientPort(router, self, replies, engine_only=frozenset({KVHandshakeRequest, AddRemoteEngine}))
        self.window = StepWindow(
            core,
            stages,
            deliver=self.port.deliver,
            fail=self._fail,
            max_cohorts=max_cohorts,
            async_scheduling=async_scheduling,
            balancer=balancer,
        )
        parallel = core.config.parallel
        self.supervisor = PipelineSupervisor(
            core,
            stages,
            self.window,
            budget=RestartBudget(parallel.max_stage_restarts, parallel.restart_window_s),
            start_timeout_s=STAGE_START_TIMEOUT_S,
            park_outputs=self._park_outputs,
            unpark_outputs=self._unpark_outputs,
            on_dead=self._lost,
        )
        self._outputs_task: asyncio.Task | None = None
        self.log = get_logger(role="engine", pp_rank=None)
        self._stop = asyncio.Event()
        self.is_dead = False
        self.is_draining = False
        self.exit_code = 0
        self.started_at = time.monotonic()

    @property
    def max_cohorts(self) -> int:
        return self.window.max_cohorts

    @property
    def async_scheduling(self) -> bool:
        return self.window.async_scheduling

    @property
    def peer_of(self) -> dict[str, bytes]:
        """Unfinished requests -> their clients."""
        return self.port.peer_of

    # ---- lifecycle -------------------------------------------------------------------------
    async def serve(self) -> int:
        self._unpark_outputs()
        tasks = [
            asyncio.create_task(self.port.serve(), name="clients"),
            asyncio.create_task(self.window.schedule_loop(), name="schedule"),
            asyncio.create_task(self.supervisor.run(), name="supervisor"),
        ]
        await self._stop.wait()
        tasks.append(self._outputs_task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.window.phases.num_steps:  # ASYNCPP_STEP_PHASES=1
            self.log.info("step_phases", **self.window.phases.summary())
        return self.exit_code

    async def drain_and_stop(self) -> None:
        """Ctrl-C / SIGTERM: refuse new work, let running requests finish within the grace period."""
        if self.is_draining or self._stop.is_set():
            return
        self.is_draining = True
        self.log.info("engine_draining", num_unfinished=len(self.peer_of), grace_period_s=self.grace_period_s)
        deadline = time.monotonic() + self.grace_period_s
        while self.peer_of and time.monotonic() < deadline and not self.is_dead:
            await asyncio.sleep(0.02)
        for request_id in list(self.peer_of):
            self.core.abort(request_id)
            await self.port.send_error(request_id, "engine shut down before the request finished", "shutdown")
        self._stop.set()

    def stop(self, exit_code: int = 0) -> None:
        self.exit_code = exit_code
        self._stop.set()

    # ---- requests (`RequestSink`) ----------------------------------------------------------
    def is_slow(self, msg: GenerateRequest) -> bool:
        return tokenizes_off_loop(msg.prompt)

    def has_request(self, request_id: str) -> bool:
        return self.core.has_request(request_id)

    async def add_request(self, msg: GenerateRequest) -> None:
        if self.is_dead:
            raise RequestRefused("engine is dead", "engine_dead")
        if self.is_draining:
            raise RequestRefused("engine is shutting down", "shutdown")
        try:
            try:
                params = SamplingParams.from_dict(msg.sampling_params)
            except InvalidRequestError:
                raise
            except (TypeError, ValueError) as e:
                raise InvalidRequestError("sampling_params", str(e)) from e
            if self.is_slow(msg):
                # Tokenizing a huge prompt must not stall every other request (one that cannot
                # fit max_model_len is refused by its length alone, before tokenizing).
                loop = asyncio.get_running_loop()
                prompt_ids = await loop.run_in_executor(None, self.core.input_processor.tokenize, msg.prompt)
                self.core.add_request(prompt_ids, params, msg.request_id, msg.kv_transfer_params)
            else:
                self.core.add_request(msg.prompt, params, msg.request_id, msg.kv_transfer_params)
        except InvalidRequestError as e:
            raise RequestRefused(e.message, "invalid_request", e.field) from e
        self.window.wake()

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.window.wake()

    async def add_remote_prefill(self, msg: RemotePrefillDone) -> None:
        try:
            self.core.add_remote_prefill(msg.request_id, msg.kv_transfer_params)
        except InvalidRequestError as e:
            self.log.info("remote_prefill_refused", request_id=msg.request_id, error=str(e))
            await self._fail(msg.request_id, str(e), "invalid_request", e.field)
            return
        self.window.wake()

    async def _fail(self, request_id: str, message: str, kind: str, error_field: str | None = None) -> None:
        """Finish a request with an error in the engine and tell its client why."""
        self.core.abort(request_id, RequestStatus.FINISHED_ERROR, message)
        await self.port.send_error(request_id, message, kind, error_field)

    async def _health(self, msg: HealthRequest) -> HealthReply:
        connector = self.core.kv_connector
        return HealthReply(msg.nonce, not self.is_dead, connector.generation if connector is not None else 0)

    async def _stats_reply(self, msg: StatsRequest) -> StatsReply:
        return StatsReply(msg.nonce, self.stats())

    async def _kv_handshake(self, msg: KVHandshakeRequest) -> KVHandshakeReply:
        connector = self.core.kv_connector
        return KVHandshakeReply(msg.nonce, connector.engine_handshake() if connector is not None else None)

    async def _add_remote_engine(self, msg: AddRemoteEngine) -> AddRemoteEngineReply:
        connector = self.core.kv_connector
        if connector is None:
            return AddRemoteEngineReply(msg.nonce, "this engine has no KV connector")
        try:
            connector.add_remote_engine(msg.handshake)
        except (TypeError, ValueError) as e:
            self.log.warning("remote_engine_refused", engine_id=msg.handshake.engine_id, error=str(e))
            return AddRemoteEngineReply(msg.nonce, str(e))
        self.log.info("remote_engine_added", engine_id=msg.handshake.engine_id, pp_size=msg.handshake.pp_size)
        self.window.wake()  # its agents reach the stages with the next plan
        return AddRemoteEngineReply(msg.nonce)

    # ---- failure ---------------------------------------------------------------------------
    async def _park_outputs(self) -> None:
        """Stop the output loop where it waits for the next output (never within a step's
        completion), so that a restart's start-up messages are read by the stage group."""
        task = self._outputs_task
        while task is not None and not task.done() and not self.window.is_reading:
            await asyncio.sleep(0.001)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _unpark_outputs(self) -> None:
        self._outputs_task = asyncio.create_task(self.window.output_loop(), name="outputs")

    async def _lost(self, lost: list[int], cause: str, waited_s: float | None, why: str) -> None:
        """Stages lost and not restarted (`PipelineSupervisor`): fail every request and stop."""
        if self.is_dead:
            return
        self.is_dead = True
        if cause == "hung":
            self.log.error(
                "stage_hung", pp_rank=lost[0], hung_pp_ranks=lost, waited_s=round(waited_s or 0.0, 3),
                step_timeout_s=self.window.step_timeout_s, num_failed_requests=len(self.peer_of), not_restarted=why,
            )  # fmt: skip
            message = (
                f"engine is dead: stage {lost[0]} hung (no output for {waited_s or 0.0:.1f} s with a step it could "
                f"run; parallel.step_timeout_s = {self.window.step_timeout_s:g})"
            )
        else:
            self.log.error("stage_died", dead_pp_ranks=lost, num_failed_requests=len(self.peer_of), not_restarted=why)
            message = f"engine is dead: stage(s) {lost} exited"
        await self._fail_all_and_stop(f"{message}; not restarted: {why}")

    async def _fail_all_and_stop(self, message: str) -> None:
        for request_id in list(self.peer_of):
            await self._fail(request_id, message, "engine_dead")
        self.window.stop()
        self.stop(exit_code=1)

    # ---- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        bm = self.core.block_manager
        window = self.window
        return {
            **dataclasses.asdict(self.core.scheduler.stats()),
            "num_steps": window.num_steps,
            "num_in_flight_steps": len(window.in_flight),
            "num_lent_steps": window.num_lent_steps,
            "num_spare_cpus": window.spare_cpus.num_spare if window.spare_cpus is not None else None,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "uptime_s": time.monotonic() - self.started_at,
            "cpu_s": time.process_time(),  # this engine process, all threads: what it takes from the stages
            "pid": os.getpid(),
            "stage_busy_s": list(window.stage_busy_s),
            "handoff_us_p50": [_percentile(h, 50) for h in window.handoff_us[:-1]],
            "handoff_us_p99": [_percentile(h, 99) for h in window.handoff_us[:-1]],
            "is_dead": self.is_dead,
            **self.supervisor.stats(),
            "stage_pids": [p.pid for p in self.stages.procs],
            "run_id": self.stages.addresses.run_id,
            **self._compute_stats(),
            **self.core.kv_stats(),
            **self.core.input_processor.grammar_stats(),
            **({"layer_balance": window.balancer.stats()} if window.balancer is not None else {}),
        }

    def _compute_stats(self) -> dict[str, Any]:
        """The compute plan and each stage's resident weight bytes (from its ready-ack)."""
        if self.compute_plan is None:
            return {}
        return compute_stats(self.compute_plan, [ready.weight_nbytes for ready in self.stages.readies])


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]
