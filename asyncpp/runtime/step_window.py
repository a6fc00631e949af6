"""`StepWindow`: the engine's pipeline of steps, two asyncio tasks over the stage group.

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
  scheduler, dispatch the next plans, then hand the step's deltas to
  `deliver` (a failed step's requests go to `fail` instead);
* KV transfers: with a connector, stages report transfers in every step's
  output (merged over stages by `EngineCore`); when nothing else runs but
  transfers are pending, the window still sends plans with no requests, at
  once to start new transfers and every `POLL_INTERVAL_S` to collect
  finished ones, so they complete while the engine is otherwise idle
  (`HELD_POLL_INTERVAL_S` when only held blocks wait for their sends: no
  request waits on them, and a prefill engine holding blocks for a decode
  engine's pull would otherwise take a core from the pull with its polls).
* step deadline: `wait_for_hang` returns the stages that had a step they could
  run for `parallel.step_timeout_s` without reporting it (`step_deadline`), so
  a stopped or cut-off stage fails the engine instead of leaving every request
  waiting forever.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from asyncpp.core.plan import StepPlan
from asyncpp.core.prefill_share import num_prefill_tokens, prefill_share
from asyncpp.core.request import RequestStatus
from asyncpp.engine.engine import EngineCore
from asyncpp.engine.layer_balance import LayerBalancer
from asyncpp.engine.outputs import RequestOutput
from asyncpp.logging import get_logger, is_debug_enabled
from asyncpp.runtime.spare_cpus import SpareCpus
from asyncpp.runtime.step_deadline import hung_stages, waiting_since
from asyncpp.runtime.stage_group import StageGroup, StagesRestartedError
from asyncpp.step_phases import step_phases
from asyncpp.wire.stage_msgs import StageOutput

# While only KV transfers are pending, the stages are polled this often (their threads move the bytes).
POLL_INTERVAL_S = 0.001
HELD_POLL_INTERVAL_S = 0.01
# Lent threads need whole spare cores: a core that others use this much is still lent (noise).
SPARE_CPU_SLACK = 0.25


@dataclass
class _InFlightStep:
    plan: StepPlan
    dispatched_at: float
    outputs: dict[int, StageOutput] = field(default_factory=dict)
    reported_at: dict[int, float] = field(default_factory=dict)  # pp_rank -> when its output arrived

    @property
    def step_id(self) -> int:
        return self.plan.step_id

    @property
    def after_step_id(self) -> int | None:
        return self.plan.after_step_id


class StepWindow:
    def __init__(
        self,
        core: EngineCore,
        stages: StageGroup,
        *,
        deliver: Callable[[list[RequestOutput]], Awaitable[None]],
        fail: Callable[[str, str, str], Awaitable[None]],
        max_cohorts: int | None = None,
        async_scheduling: bool = False,
        balancer: LayerBalancer | None = None,
    ) -> None:
        self.core = core
        self.stages = stages
        self.deliver = deliver  # a completed step's deltas
        self.fail = fail  # (request id, message, kind): a failed step's requests
        self.pp_size = stages.pp_size
        self.max_cohorts = max_cohorts or self.pp_size
        if not 1 <= self.max_cohorts <= self.pp_size + 1:
            raise ValueError(f"max_cohorts must be in 1..pp_size + 1 = {self.pp_size + 1}, got {max_cohorts}")
        self.async_scheduling = async_scheduling
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
        self.step_timeout_s = parallel.step_timeout_s
        self.last_output_at = [0.0] * self.pp_size  # each stage's latest output (monotonic s)
        # Each cohort's in-flight step ids, oldest first: one, or two with async scheduling.
        self.cohorts: list[list[int]] = []
        self.last_dispatched_step_id = -1
        self._last_prefill_tokens = 0  # prompt tokens of the plan dispatched last
        self.log = get_logger(role="engine", pp_rank=None)
        self._wake = asyncio.Event()
        self._dispatch_lock = asyncio.Lock()
        self._next_poll_at = 0.0
        self._poll_timer: asyncio.TimerHandle | None = None
        self._is_debug = is_debug_enabled(self.log)  # per-step debug events cost even when filtered out
        self.is_stopped = False  # the engine is dead: nothing more is dispatched
        self.is_paused = False  # the stages restart (`pause`): nothing is dispatched meanwhile
        self._forgotten_through = -1  # `pause` dropped the steps in flight, none later than this one
        self.is_reading = False  # `output_loop` waits for the next output (and only there)
        self.num_steps = 0
        self.num_lent_steps = 0  # dispatched with lent threads
        self.stage_busy_s = [0.0] * self.pp_size
        self.handoff_us: list[collections.deque] = [collections.deque(maxlen=10000) for _ in range(self.pp_size)]
        self.phases = step_phases()  # off unless ASYNCPP_STEP_PHASES=1

    def wake(self) -> None:
        """New work (a request, an abort): fill the window."""
        self._wake.set()

    def stop(self) -> None:
        self.is_stopped = True
        self.in_flight.clear()
        self.cohorts.clear()

    def pause(self) -> int:
        """The stages are lost: dispatch nothing until `resume`, and forget the steps in flight
        (never completed; an output of theirs that still comes is dropped). Returns how many."""
        self.is_paused = True
        self._forgotten_through = self.last_dispatched_step_id  # every step before it was already complete
        num_steps = len(self.in_flight)
        self.in_flight.clear()
        self.cohorts.clear()
        self._last_prefill_tokens = 0
        return num_steps

    def resume(self) -> None:
        """New stages are up: the step deadline starts over, and the window fills again."""
        self.is_paused = False
        self.last_output_at = [time.monotonic()] * self.pp_size
        if self.spare_cpus is not None:  # the stages are other processes now
            self.spare_cpus.track([os.getpid(), *(p.pid for p in self.stages.procs)])
        self._wake.set()

    # ---- scheduling ------------------------------------------------------------------------
    async def schedule_loop(self) -> None:
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
        phases, clock = self.phases, time.perf_counter
        async with self._dispatch_lock:
            while not self.is_stopped and not self.is_paused and (plan := self._timed_schedule()) is not None:
                if self.max_lent_threads and len(self.cohorts) == 1 and (n := self._lent_threads()):
                    plan = dataclasses.replace(plan, num_threads=n)
                    self.num_lent_steps += 1
                if self.balancer is not None and not plan.is_empty:
                    in_flight = (step.plan for step in self.in_flight.values())
                    plan = dataclasses.replace(plan, layer_bounds=self.balancer.bounds(plan, in_flight))
                self.in_flight[plan.step_id] = _InFlightStep(plan, time.monotonic())
                self.last_dispatched_step_id = plan.step_id
                self._last_prefill_tokens = num_prefill_tokens(plan)
                t0 = clock()
                try:
                    await self.stages.broadcast(plan)
                except StagesRestartedError:
                    return  # `pause` forgot the plan; the new stages get the next ones
                phases.add("send_plan", clock() - t0)
                if self._is_debug:
                    self.log.debug(
                        "step_dispatched",
                        step_id=plan.step_id,
                        num_reqs=plan.num_reqs,
                        num_tokens=plan.num_tokens,
                        num_drafts=plan.num_draft_tokens,
                        after_step_id=plan.after_step_id,
                        num_threads=plan.num_threads,
                        layer_bounds=plan.layer_bounds,
                    )

    def _timed_schedule(self) -> StepPlan | None:
        t0 = time.perf_counter()
        plan = self._schedule_next() or self._schedule_poll()
        self.phases.add("schedule", time.perf_counter() - t0)
        return plan

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
        self._next_poll_at = now + (POLL_INTERVAL_S if scheduler.has_pending_loads() else HELD_POLL_INTERVAL_S)
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
    async def output_loop(self) -> None:
        while True:
            self.is_reading = True  # cancelled only here (a restart takes the queue): no output half-applied
            try:
                out = await self.stages.outputs.get()
            finally:
                self.is_reading = False
            if not isinstance(out, StageOutput):
                continue
            step = self.in_flight.get(out.step_id)
            if step is None:
                if out.step_id > self._forgotten_through:  # a late output of a dropped step is expected
                    self.log.warning("unknown_step_output", step_id=out.step_id, pp_rank=out.pp_rank)
                continue
            step.outputs[out.pp_rank] = out
            step.reported_at[out.pp_rank] = self.last_output_at[out.pp_rank] = time.monotonic()
            self.stage_busy_s[out.pp_rank] += out.busy_s
            if out.pp_rank < self.pp_size - 1 and out.error is None:
                self.handoff_us[out.pp_rank].append(out.handoff_us)
            if len(step.outputs) == self.pp_size:
                await self._complete(step)

    async def wait_for_hang(self) -> tuple[list[int], float]:
        """(Ranks of the hung stages, longest waiting first; how long the first waited), once one
        has waited `step_timeout_s`. Wakes when the earliest clock runs out, and at least every
        quarter deadline to look at steps dispatched meanwhile: a handful of wake-ups a minute."""
        while True:
            since = waiting_since(self.in_flight.values(), self.last_output_at)
            now = time.monotonic()
            if not self.is_stopped and (hung := hung_stages(since, now, self.step_timeout_s)):
                return hung, now - since[hung[0]]
            next_check_at = min(since.values(), default=now) + self.step_timeout_s
            await asyncio.sleep(max(0.001, min(next_check_at - now, self.step_timeout_s / 4)))

    async def _complete(self, step: _InFlightStep) -> None:
        del self.in_flight[step.plan.step_id]
        self._retire(step.plan.step_id)
        self.num_steps += 1
        # By stage, not by arrival: an earlier stage's error is the cause of a later one's (a stage
        # whose forward failed hands the next an empty notice, which fails there too).
        errors = [step.outputs[rank].error for rank in sorted(step.outputs) if step.outputs[rank].error]
        if errors:
            self.log.error("step_failed", step_id=step.plan.step_id, errors=errors)
            failed = self.core.process_failed_step(step.plan, self._stage_outputs(step))
            self._log_completed(step)
            for request_id, why in [(r, errors[0]) for r in failed] + self.core.take_failed_requests():
                await self.fail(request_id, why, "internal")
            self._wake.set()  # the window has room again
        else:
            # The scheduler is up to date once this returns, stop strings included (they finish
            # requests during detokenization), so the next plans can leave before the deltas.
            phases, t0 = self.phases, time.perf_counter()
            phases.start_step()
            results = self.core.process_output(step.plan, self._stage_outputs(step))
            phases.add("process_output", time.perf_counter() - t0)
            if self.balancer is not None:
                self.balancer.observe(step.plan, [step.outputs[rank].busy_s for rank in range(self.pp_size)])
            if (policy := self.core.scheduler.draft_policy) is not None:  # what a wider step costs
                policy.observe_step(step.plan.num_tokens, sum(o.busy_s for o in step.outputs.values()))
            self._log_completed(step)  # before the next dispatch: the log shows the true window
            failed = self.core.take_failed_requests()  # a KV load within the step failed
            for request_id, why in failed:
                self.core.abort(request_id, RequestStatus.FINISHED_ERROR, why)
            if failed:  # what they sampled came from KV that never arrived
                failed_ids = {request_id for request_id, _ in failed}
                results = [out for out in results if out.request_id not in failed_ids]
            await self._dispatch()
            t0 = time.perf_counter()
            await self.deliver(results)
            phases.add("deliver", time.perf_counter() - t0)
            for request_id, why in failed:
                await self.fail(request_id, why, "internal")

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
