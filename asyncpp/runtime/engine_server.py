"""`EngineServer`: the engine process's asyncio loop over the pipeline stages.

Four tasks share one loop and never block it:
* clients: decode requests (bad frames get an `ErrorReply`), validate, route deltas;
* schedule: keep up to `max_cohorts` cohorts in flight (default pp_size, at most
  pp_size + 1), disjoint sets of about 1/max_cohorts of the live requests,
  dispatching as soon as the window has room. One cohort per stage keeps the
  batches, and so the work per token, the same as without pipeline
  parallelism would at half the concurrency. With async scheduling each
  cohort has two steps in flight: its next one is scheduled as soon as the
  current one is dispatched, with placeholders for the tokens the current one
  samples (the last stage hands them straight to the first), so the engine's
  turnaround overlaps compute. Without it, a window of pp_size + 1 hides the
  turnaround but splits the requests into smaller cohorts, which on a CPU
  whose decode reads every weight once per step costs more than it hides;
* outputs: collect one `StageOutput` per stage per step, matched by step_id,
  and complete a step only when every stage has reported it: update the
  scheduler, dispatch the next plans, then send each client one
  `RequestDeltas` frame with all of its deltas of the step;
* KV transfers: with a connector, stages report transfers in every step's
  output (merged over stages by `EngineCore`); when nothing else runs but
  transfers are pending, the engine still sends plans with no requests, at
  once to start new transfers and every `POLL_INTERVAL_S` to collect
  finished ones, so they complete while the engine is otherwise idle;
* watchdog: sleeps until a stage process exits, then fails every request with
  an engine-dead error.
A plan whose cohort is the only one in flight carries `num_threads` = every
stage's threads (CPU, `parallel.lend_idle_threads`), as far as other work on
the machine leaves cores spare (`SpareCpus`): its steps pass through the stages
one at a time, so the other stages' cores would idle. A step dispatched alone
keeps them to its end even if a second cohort starts meanwhile.
Every CPU-millisecond spent here is taken from the stages when there are as
many cores as stages, so the per-step path avoids work nobody asked for
(debug events are built only when debug logging is on).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from asyncpp.core.plan import StepPlan
from asyncpp.core.prefill_share import num_prefill_tokens, prefill_share
from asyncpp.core.request import RequestStatus
from asyncpp.engine.compute_plan import ComputePlan, compute_stats
from asyncpp.engine.engine import EngineCore
from asyncpp.engine.layer_balance import LayerBalancer
from asyncpp.engine.outputs import RequestOutput
from asyncpp.errors import InvalidRequestError
from asyncpp.logging import get_logger, is_debug_enabled
from asyncpp.runtime.spare_cpus import SpareCpus
from asyncpp.runtime.stage_group import StageGroup
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_msgs import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    RequestDeltas,
    StatsReply,
    StatsRequest,
)
from asyncpp.wire.codec import WireError
from asyncpp.wire.queues import PeerGoneError, RouterQueue
from asyncpp.wire.stage_msgs import StageOutput


# While only KV transfers are pending, the stages are polled this often (their threads move the bytes).
POLL_INTERVAL_S = 0.001
# Lent threads need whole spare cores: a core that others use this much is still lent (noise).
SPARE_CPU_SLACK = 0.25


@dataclass
class _InFlightStep:
    plan: StepPlan
    dispatched_at: float
    outputs: dict[int, StageOutput] = field(default_factory=dict)


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
        self.max_cohorts = max_cohorts or self.pp_size
        if not 1 <= self.max_cohorts <= self.pp_size + 1:
            raise ValueError(f"max_cohorts must be in 1..pp_size + 1 = {self.pp_size + 1}, got {max_cohorts}")
        self.async_scheduling = async_scheduling
        self.grace_period_s = grace_period_s
        self.compute_plan = compute_plan  # what the stages compute with, for stats
        self.balancer = balancer  # per-step layer bounds (`parallel.shift_layers`); None: the static split
        parallel = core.config.parallel
        self.num_threads = parallel.num_threads  # each stage's own
        is_cpu = all(device == "cpu" for device in core.config.stage_devices)
        is_lending = parallel.lend_idle_threads and is_cpu and self.pp_size > 1
        # A lone cohort's threads, at most: every stage's. 0 = no lending.
        self.max_lent_threads = parallel.num_threads * self.pp_size if is_lending else 0
        pids = [os.getpid(), *(p.pid for p in stages.procs)]
        self.spare_cpus: SpareCpus | None = SpareCpus(pids) if is_lending else None
        self.in_flight: dict[int, _InFlightStep] = {}
        # Each cohort's in-flight step ids, oldest first: one, or two with async scheduling.
        self.cohorts: list[list[int]] = []
        self.last_dispatched_step_id = -1
        self._last_prefill_tokens = 0  # prompt tokens of the plan dispatched last
        self.peer_of: dict[str, bytes] = {}
        self.log = get_logger(role="engine", pp_rank=None)
        self._wake = asyncio.Event()
        self._dispatch_lock = asyncio.Lock()
        self._next_poll_at = 0.0
        self._poll_timer: asyncio.TimerHandle | None = None
        self._is_debug = is_debug_enabled(self.log)  # per-step debug events cost even when filtered out
        self._stop = asyncio.Event()
        self.is_dead = False
        self.is_draining = False
        self.exit_code = 0
        self.started_at = time.monotonic()
        self.num_steps = 0
        self.num_lent_steps = 0  # dispatched with lent threads
        self.stage_busy_s = [0.0] * self.pp_size
        self.handoff_us: list[collections.deque] = [collections.deque(maxlen=10000) for _ in range(self.pp_size)]

    # ---- lifecycle -------------------------------------------------------------------------
    async def serve(self) -> int:
        tasks = [
            asyncio.create_task(self._client_loop(), name="clients"),
            asyncio.create_task(self._output_loop(), name="outputs"),
            asyncio.create_task(self._schedule_loop(), name="schedule"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
        ]
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
            await self._send_error(request_id, "engine shut down before the request finished", "shutdown")
        self._stop.set()

    def stop(self, exit_code: int = 0) -> None:
        self.exit_code = exit_code
        self._stop.set()

    # ---- clients ---------------------------------------------------------------------------
    async def _client_loop(self) -> None:
        while True:
            peer, msg = await self.router.get()
            try:
                await self._handle_client_msg(peer, msg)
            except PeerGoneError:
                await self._drop_peer(peer)
            except Exception as e:  # noqa: BLE001 - one client's message must never end the loop serving all
                self.log.exception("client_msg_failed", peer=peer.hex(), error=repr(e))
                try:
                    await self.router.put(peer, ErrorReply(getattr(msg, "request_id", None), repr(e), "internal"))
                except PeerGoneError:
                    await self._drop_peer(peer)

    async def _handle_client_msg(self, peer: bytes, msg: Any) -> None:
        if isinstance(msg, WireError):
            self.log.warning("bad_frame", peer=peer.hex(), error=str(msg))
            await self.router.put(peer, ErrorReply(None, str(msg), "bad_frame"))
        elif isinstance(msg, GenerateRequest):
            await self._add_request(peer, msg)
        elif isinstance(msg, AbortRequest):
            if self.peer_of.get(msg.request_id) == peer:
                await self._finish_abort(msg.request_id)
        elif isinstance(msg, HealthRequest):
            await self.router.put(peer, HealthReply(msg.nonce, not self.is_dead))
        elif isinstance(msg, StatsRequest):
            await self.router.put(peer, StatsReply(msg.nonce, self.stats()))
        else:
            await self.router.put(peer, ErrorReply(None, f"unexpected message {type(msg).__name__}", "bad_frame"))

    async def _add_request(self, peer: bytes, msg: GenerateRequest) -> None:
        if self.is_dead:
            await self.router.put(peer, ErrorReply(msg.request_id, "engine is dead", "engine_dead"))
            return
        if self.is_draining:
            await self.router.put(peer, ErrorReply(msg.request_id, "engine is shutting down", "shutdown"))
            return
        try:
            try:
                params = SamplingParams.from_dict(msg.sampling_params)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError("sampling_params", str(e)) from e
            loop = asyncio.get_running_loop()
            if isinstance(msg.prompt, str) and len(msg.prompt) > 20000:
                # Tokenizing a huge prompt must not stall every other request.
                prompt_ids = await loop.run_in_executor(None, self.core.tokenizer.encode, msg.prompt)
                self.core.add_request(prompt_ids, params, msg.request_id)
            else:
                self.core.add_request(msg.prompt, params, msg.request_id)
        except InvalidRequestError as e:
            self.log.info("request_rejected", request_id=msg.request_id, error=str(e))
            await self.router.put(peer, ErrorReply(msg.request_id, str(e), "invalid_request", e.field))
            return
        self.peer_of[msg.request_id] = peer
        self._wake.set()

    async def _finish_abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.peer_of.pop(request_id, None)
        self._wake.set()

    async def _fail(self, request_id: str, message: str, kind: str) -> None:
        """Finish a request with an error in the engine and tell its client why."""
        self.core.abort(request_id, RequestStatus.FINISHED_ERROR, message)
        await self._send_error(request_id, message, kind)

    async def _drop_peer(self, peer: bytes) -> None:
        gone = [rid for rid, p in self.peer_of.items() if p == peer]
        for rid in gone:
            await self._finish_abort(rid)
        if gone:
            self.log.info("client_gone", peer=peer.hex(), num_aborted=len(gone))

    async def _send_error(self, request_id: str, message: str, kind: str) -> None:
        peer = self.peer_of.pop(request_id, None)
        if peer is None:
            return
        try:
            await self.router.put(peer, ErrorReply(request_id, message, kind))
        except PeerGoneError:
            pass

    async def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Send one step's deltas: one `RequestDeltas` frame per client."""
        by_peer: dict[bytes, list[RequestOutput]] = {}
        for out in outputs:
            peer = self.peer_of.get(out.request_id)
            if peer is None:
                continue
            if out.finished:
                del self.peer_of[out.request_id]
            by_peer.setdefault(peer, []).append(out)
        gone: list[bytes] = []
        for peer, peer_outputs in by_peer.items():
            try:
                await self.router.put(peer, RequestDeltas.of(peer_outputs))
            except PeerGoneError:
                gone.append(peer)
        for peer in gone:
            await self._drop_peer(peer)

    # ---- scheduling ------------------------------------------------------------------------
    async def _schedule_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._dispatch()

    async def _dispatch(self) -> None:
        """Fill the in-flight window with fresh plans.

        Called by the schedule loop (new requests, aborts) and by `_complete`
        right after the scheduler took a step's output, before its deltas are
        sent, so stages never wait on delivery to clients. The lock keeps every
        stage's plans in step order when both call at once.
        """
        async with self._dispatch_lock:
            while not self.is_dead and (plan := self._schedule_next() or self._schedule_poll()) is not None:
                if self.max_lent_threads and len(self.cohorts) == 1 and (n := self._lent_threads()):
                    plan = dataclasses.replace(plan, num_threads=n)
                    self.num_lent_steps += 1
                if self.balancer is not None and not plan.is_empty:
                    plan = dataclasses.replace(plan, layer_bounds=self.balancer.bounds(plan))
                self.in_flight[plan.step_id] = _InFlightStep(plan, time.monotonic())
                self.last_dispatched_step_id = plan.step_id
                self._last_prefill_tokens = num_prefill_tokens(plan)
                await self.stages.broadcast(plan)
                if self._is_debug:
                    self.log.debug(
                        "step_dispatched",
                        step_id=plan.step_id,
                        num_reqs=plan.num_reqs,
                        num_tokens=plan.num_tokens,
                        after_step_id=plan.after_step_id,
                        num_threads=plan.num_threads,
                        layer_bounds=plan.layer_bounds,
                    )

    def _schedule_next(self) -> StepPlan | None:
        """The first step of a new cohort, else (async) the next step of the cohort dispatched longest ago.

        Stages run plans in dispatch order, and a cohort's next step needs the tokens of its
        current one. It goes out only once other cohorts' steps (pp_size - 1 of them, or as
        many as there are other cohorts) were dispatched after that one: those keep the first
        stage busy while the current step finishes on the later stages. Right behind its
        parent it would stall the first stage for a whole pass through the pipeline.
        """
        scheduler = self.core.scheduler
        if len(self.cohorts) < self.max_cohorts:
            plan = scheduler.schedule(max_num_reqs=self._cohort_size(), max_num_prefill_tokens=self._prefill_share())
            if plan is not None:
                self.cohorts.append([plan.step_id])
                return plan
        if self.async_scheduling:
            spacing = min(self.pp_size - 1, len(self.cohorts) - 1)
            for cohort in sorted((c for c in self.cohorts if len(c) == 1), key=lambda c: c[0]):
                if self.last_dispatched_step_id - cohort[0] < spacing:
                    break  # the later ones were dispatched even more recently
                plan = scheduler.schedule(
                    max_num_reqs=self._cohort_size(),
                    after_step_id=cohort[0],
                    max_num_prefill_tokens=self._prefill_share(),
                )
                if plan is not None:
                    cohort.append(plan.step_id)
                    return plan
        return None

    def _lent_threads(self) -> int:
        """Threads for a plan whose cohort is alone in flight: every stage's, on spare cores; 0 = its own."""
        num_spare = self.spare_cpus.refresh(time.monotonic())
        num_threads = min(self.max_lent_threads, math.floor(num_spare + SPARE_CPU_SLACK))
        return num_threads if num_threads > self.num_threads else 0

    def _schedule_poll(self) -> StepPlan | None:
        """A plan with no requests, when nothing is in flight but KV transfers are pending.

        New transfers go out at once; finished ones are collected every
        `POLL_INTERVAL_S` (a timer wakes the schedule loop), not in a busy loop
        that would take the cores the transfers run on.
        """
        scheduler = self.core.scheduler
        if self.in_flight or not scheduler.has_pending_transfers():
            return None
        connector = self.core.kv_connector
        now = time.monotonic()
        if not (connector is not None and connector.has_unsent_metadata()) and now < self._next_poll_at:
            if self._poll_timer is None:
                self._poll_timer = asyncio.get_running_loop().call_later(self._next_poll_at - now, self._poll_due)
            return None
        self._next_poll_at = now + POLL_INTERVAL_S
        return scheduler.schedule(allow_empty=True)

    def _poll_due(self) -> None:
        self._poll_timer = None
        self._wake.set()

    def _cohort_size(self) -> int:
        # Spread the live requests over the cohorts (disjoint), so every stage has work.
        num_live = self.core.scheduler.num_running + self.core.scheduler.num_waiting
        return max(1, math.ceil(num_live / self.max_cohorts))

    def _prefill_share(self) -> int | None:
        """Async scheduling: the prompt tokens a plan may take (`asyncpp.core.prefill_share`)."""
        if not self.async_scheduling or self.max_cohorts == 1:
            return None
        return prefill_share(self.core.scheduler.num_pending_prefill_tokens, self.max_cohorts, self._last_prefill_tokens)

    def _retire(self, step_id: int) -> None:
        for cohort in self.cohorts:
            if cohort[0] == step_id:
                cohort.pop(0)
                if not cohort:
                    self.cohorts.remove(cohort)
                return

    # ---- stage outputs ---------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            out = await self.stages.outputs.get()
            if not isinstance(out, StageOutput):
                continue
            step = self.in_flight.get(out.step_id)
            if step is None:
                self.log.warning("unknown_step_output", step_id=out.step_id, pp_rank=out.pp_rank)
                continue
            step.outputs[out.pp_rank] = out
            self.stage_busy_s[out.pp_rank] += out.busy_s
            if out.pp_rank < self.pp_size - 1 and out.error is None:
                self.handoff_us[out.pp_rank].append(out.handoff_us)
            if len(step.outputs) == self.pp_size:
                await self._complete(step)

    async def _complete(self, step: _InFlightStep) -> None:
        del self.in_flight[step.plan.step_id]
        self._retire(step.plan.step_id)
        self.num_steps += 1
        errors = [o.error for o in step.outputs.values() if o.error]
        if errors:
            self.log.error("step_failed", step_id=step.plan.step_id, errors=errors)
            failed = self.core.process_failed_step(step.plan, self._stage_outputs(step))
            self._log_completed(step)
            for request_id in failed:
                await self._fail(request_id, errors[0], "internal")
            self._wake.set()  # the window has room again
        else:
            # The scheduler is up to date once this returns, stop strings included (they finish
            # requests during detokenization), so the next plans can leave before the deltas.
            results = self.core.process_output(step.plan, self._stage_outputs(step))
            if self.balancer is not None:
                self.balancer.observe(step.plan, [step.outputs[rank].busy_s for rank in range(self.pp_size)])
            self._log_completed(step)  # before the next dispatch: the log shows the true window
            await self._dispatch()
            await self._deliver(results)

    def _stage_outputs(self, step: _InFlightStep) -> list:
        return [step.outputs[rank].output for rank in range(self.pp_size)]

    def _log_completed(self, step: _InFlightStep) -> None:
        if self._is_debug:
            self.log.debug(
                "step_completed",
                step_id=step.plan.step_id,
                num_reqs=step.plan.num_reqs,
                num_tokens=step.plan.num_tokens,
                duration_ms=round((time.monotonic() - step.dispatched_at) * 1e3, 3),
                num_running=self.core.scheduler.num_running,
                num_waiting=self.core.scheduler.num_waiting,
                kv_usage=round(self.core.block_manager.usage, 4),
            )

    # ---- failure ---------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        await self._engine_dead(await self.stages.wait_for_death())

    async def _engine_dead(self, dead: list[int]) -> None:
        self.is_dead = True
        self.log.error("stage_died", dead_pp_ranks=dead, num_failed_requests=len(self.peer_of))
        message = f"engine is dead: stage(s) {dead} exited"
        for request_id in list(self.peer_of):
            await self._fail(request_id, message, "engine_dead")
        self.in_flight.clear()
        self.cohorts.clear()
        self.stop(exit_code=1)

    # ---- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        bm = self.core.block_manager
        return {
            **dataclasses.asdict(self.core.scheduler.stats()),
            "num_steps": self.num_steps,
            "num_in_flight_steps": len(self.in_flight),
            "num_lent_steps": self.num_lent_steps,
            "num_spare_cpus": self.spare_cpus.num_spare if self.spare_cpus is not None else None,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "uptime_s": time.monotonic() - self.started_at,
            "cpu_s": time.process_time(),  # this engine process, all threads: what it takes from the stages
            "pid": os.getpid(),
            "stage_busy_s": list(self.stage_busy_s),
            "handoff_us_p50": [_percentile(h, 50) for h in self.handoff_us[:-1]],
            "handoff_us_p99": [_percentile(h, 99) for h in self.handoff_us[:-1]],
            "is_dead": self.is_dead,
            "stage_pids": [p.pid for p in self.stages.procs],
            "run_id": self.stages.addresses.run_id,
            **self._compute_stats(),
            **self.core.kv_stats(),
            **({"layer_balance": self.balancer.stats()} if self.balancer is not None else {}),
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
