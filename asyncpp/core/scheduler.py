"""`Scheduler`: continuous batching over the paged KV cache, vLLM v1 style.

There are no prefill and decode phases: each step every scheduled request
computes up to `num_tokens - num_computed_tokens` tokens (a prompt chunk, a
recompute after preemption, or one decode token) within a token budget of
`max_num_batched_tokens` and at most `max_num_seqs` running requests.

Contract
* `schedule(max_num_reqs=None)` returns a fresh `StepPlan` of at most
  `max_num_reqs` requests, or None when no request is eligible. It may be
  called again before earlier plans come back (the pipeline keeps several
  in flight, and caps cohorts to spread requests over them): an in-flight
  request (`is_in_flight`) is not scheduled again, so successive plans hold
  disjoint cohorts.
* Async scheduling: `schedule(max_num_reqs, after_step_id=S)` may also
  continue the requests of in-flight plan S (and no other in-flight ones):
  a token S samples appears as `PLACEHOLDER_TOKEN_ID`, for the first stage
  to fill in, and the plan names S in `after_step_id`. A decoding request
  is in at most two in-flight plans, and a plan must come back after the
  one it follows. A prompt's chunks need no token: any plan may take the
  next one, however many plans hold the earlier ones, and such a floating
  chunk does not count against `max_num_reqs` (so a cohort of decoding
  requests still takes its share of a long prompt: cohorts stay even). A
  request finished by the token S samples computes one wasted token in the
  next plan (never for `max_tokens`, known in advance).
* Scheduling advances `num_computed_tokens` at once (the stages are writing
  that KV); `update_from_output` only appends sampled tokens and runs the
  token-level stop checks. Plans may come back in any order; they are matched
  by `step_id`. A request that should have sampled but got no token (a failed
  step) is rolled back to the step's start, to be recomputed or finished by
  the caller.
* Speculative decoding (a `DraftPolicy`; `scheduler_spec.py`): a decode step
  may also verify the drafts the proposer made from the request's latest
  output (`draft_token_ids` of `update_from_output`), never part of its tokens;
  rejected ones roll back. With async scheduling a drafting request is
  continued optimistically, void if the plan before rejects any draft.
* A request finished while in flight (abort, stop string) frees its blocks
  now; its late output is dropped, and its id stays taken until that plan is
  back, so a new request cannot inherit the old one's in-flight step.
* `finished_req_ids` of a plan lists requests the runner has state for that
  finished since the previous plan; the runner should drop those before
  adding `new_requests` (an id may reappear as a new request). Preempted
  requests keep their runner state and are re-sent in `new_requests`.

KV connector (optional): the contract is in `asyncpp.core.scheduler_kv`.

Priority is arrival order (order of `add_request`), everywhere:
* Running requests are served oldest first; waiting ones are admitted FCFS,
  and a preempted request re-enters the waiting queue ahead of every request
  that arrived after it. A waiting request that does not fit (blocks, or its
  whole prompt without chunked prefill) stops admission for the step, so
  later requests never jump the queue.
* When a running request cannot get blocks it preempts (by recompute) the
  youngest running request that is neither in flight nor already scheduled,
  and retries. If no younger request can be preempted:
  - younger ones exist but are all in flight: it stalls for this step,
    keeping its KV, and preempts one of them when they are back. Preempting
    itself would throw away the KV of an older request for a younger one,
    and two such requests can livelock, each preempting itself in turn.
  - it is the youngest running request: it preempts itself.
  A step where any running request was preempted or stalled admits no new
  requests (they would take the blocks just freed or needed).
Liveness: victims are always younger than their preemptor, and a request
preempts itself only as the youngest running one, so the oldest running
request is never preempted (the cache holds `max_model_len` tokens, checked
at start-up, so alone it always fits) and always progresses.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from asyncpp.core.outputs import RequestUpdate, SchedulerStats
from asyncpp.core.plan import StepPlan
from asyncpp.core.request import Request, RequestStatus
from asyncpp.core.request_queues import RequestQueues
from asyncpp.core.scheduler_admission import AdmissionScheduling
from asyncpp.core.scheduler_kv import KVTransferScheduling
from asyncpp.core.scheduler_recovery import RecoveryScheduling
from asyncpp.core.scheduler_spec import SpecDecodeScheduling
from asyncpp.core.step_builder import StepBuilder
from asyncpp.core.stop import check_stop
from asyncpp.kv.block_manager import BlockManager
from asyncpp.kv_transfer.base import KVConnectorScheduler
from asyncpp.kv_transfer.metadata import KVConnectorOutput
from asyncpp.speculative.policy import DraftPolicy


class Scheduler(AdmissionScheduling, KVTransferScheduling, SpecDecodeScheduling, RecoveryScheduling):
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = False,
        connector: KVConnectorScheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
        draft_policy: DraftPolicy | None = None,
    ) -> None:
        """`clock`: what KV transfer deadlines are measured with (tests pass their own).
        `draft_policy`: speculative decoding's (None: off)."""
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        num_cache_tokens = block_manager.num_blocks * block_manager.block_size
        if num_cache_tokens < max_model_len:
            # Otherwise a long request could never be scheduled, even alone: a deadlock.
            raise ValueError(
                f"the KV cache holds {num_cache_tokens} tokens ({block_manager.num_blocks} blocks of "
                f"{block_manager.block_size}), fewer than max_model_len={max_model_len}; "
                "give the cache more memory or lower max_model_len"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_model_len={max_model_len} "
                "when chunked prefill is disabled (a whole prompt must fit in one step)"
            )
        self._block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.async_scheduling = async_scheduling
        # Live requests, plus finished ones whose last plan is still in flight.
        self._requests: dict[str, Request] = {}
        self._queues = RequestQueues()
        self._in_flight: dict[int, list[Request]] = {}  # step_id -> cohort, parallel to plan.scheduled
        self._runner_known_ids: set[str] = set()  # sent in new_requests, not yet in finished_req_ids
        self._finished_req_ids: list[str] = []  # for the next plan
        self._next_step_id = 0
        self._num_preemptions = 0
        self._init_kv_transfer(connector, clock)
        self._init_spec_decode(draft_policy)

    # ------------------------------------------------------------------ queries
    @property
    def num_running(self) -> int:
        return len(self._queues.running)

    @property
    def num_waiting(self) -> int:
        return len(self._queues.waiting)

    @property
    def num_in_flight_steps(self) -> int:
        return len(self._in_flight)

    @property
    def kv_usage(self) -> float:
        return self._block_manager.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self._queues.running or self._queues.waiting or self._waiting_for_remote or self._parked)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def stats(self) -> SchedulerStats:
        bm = self._block_manager
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_in_flight_steps=self.num_in_flight_steps,
            kv_usage=bm.usage,
            num_preemptions=self._num_preemptions,
            num_prefix_cache_queries_tokens=bm.num_prefix_cache_queries_tokens,
            num_prefix_cache_hit_tokens=bm.num_prefix_cache_hit_tokens,
            num_waiting_for_remote_kvs=len(self._waiting_for_remote),
            num_external_prefix_hit_tokens=self.num_external_hit_tokens,
            num_failed_load_tokens=self.num_failed_load_tokens,
            **self._spec_decode_stats(),
        )

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.status is not RequestStatus.WAITING or request.is_in_flight or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} must be a fresh WAITING request")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        self._requests[request.request_id] = request
        self._queues.add(request)
        if request.awaits_remote_tokens:
            if self.connector is None:
                raise ValueError(f"request {request.request_id!r} awaits remote tokens, and there is no KV connector")
            self._await_remote_tokens(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop string) the given requests; unknown or finished ids are skipped."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            self._release(request)
            finished.append(request)
        return finished

    # ------------------------------------------------------------------ the step
    def schedule(
        self,
        max_num_reqs: int | None = None,
        after_step_id: int | None = None,
        max_num_prefill_tokens: int | None = None,
        allow_empty: bool = False,
    ) -> StepPlan | None:
        """The next plan: idle requests, and with `after_step_id` also that in-flight plan's requests.

        A request of plan `after_step_id` continues in the new plan before the
        output is back (async scheduling): with its next prompt chunk, or, when
        that plan samples its next token, with a placeholder the first stage
        replaces by the sampled token. One that would surely finish there
        (`max_tokens`, `max_model_len`) is not continued. With
        `async_scheduling`, a request whose prompt chunk is in flight may also
        continue its prompt in any plan (no token to wait for).
        `max_num_prefill_tokens` caps the prompt tokens of the plan (chunked
        prefill only), so prompts can be spread evenly over the cohorts' plans.
        With `allow_empty`, a plan comes back even with no request in it (it
        carries the KV connector's metadata, or just polls the stages).
        """
        num_prefill_budget = self.max_num_batched_tokens
        if max_num_prefill_tokens is not None and self.enable_chunked_prefill:
            num_prefill_budget = max(1, max_num_prefill_tokens)
        step = StepBuilder(self._next_step_id, self.max_num_batched_tokens, max_num_reqs, num_prefill_budget)
        is_blocked = False  # a running request was preempted or stalled: admit nobody new
        running = self._queues.running
        num_step_reqs = len(running) if max_num_reqs is None else min(len(running), max_num_reqs)
        drafting = self.draft_policy is not None
        i = 0
        while i < len(running) and step.num_budget_tokens > 0:
            request = running[i]
            if after_step_id is not None and self._continue_decoding(request, after_step_id, step):
                i += 1
                continue
            # Each step asks this of every running request: its counts are read once, not per check.
            num_tokens = request.num_tokens
            is_floating = False  # in flight, with known tokens left (`Request.is_floating`)
            if request.num_in_flight:
                if not request.is_only_void_in_flight and not self._can_continue(request, after_step_id, num_tokens):
                    i += 1
                    continue
                is_floating = request.num_computed_tokens < num_tokens
            if not (is_floating or step.has_room):
                i += 1
                continue
            num_new_tokens = num_tokens - request.num_computed_tokens
            num_placeholders = num_draft_placeholders = 0
            drafts = None
            if num_new_tokens <= 0:  # its plan in flight samples the next token (after its drafts)
                num_new_tokens = num_placeholders = 1
                if drafting and request.draft_token_ids:  # it drafts: so will that plan
                    num_in_flight = request.num_draft_tokens + 1  # tokens that plan samples, if all accepted
                    num_draft_placeholders = self._num_drafts(request, num_in_flight, step.num_budget_tokens, num_step_reqs)
                    num_new_tokens += num_draft_placeholders
            elif num_new_tokens == 1 and drafting and request.draft_token_ids:
                drafts = request.draft_token_ids[: self._num_drafts(request, 0, step.num_budget_tokens, num_step_reqs)]
                num_new_tokens += len(drafts)
            if num_new_tokens > step.num_budget_tokens and not self.enable_chunked_prefill:
                i += 1
                continue
            num_new_tokens = min(num_new_tokens, step.num_budget_tokens)
            is_chunk = num_new_tokens > 1 and not drafts and not num_placeholders  # a prompt chunk (or a recompute)
            if is_chunk:
                if step.num_prefill_budget == 0:
                    i += 1
                    continue
                num_new_tokens = min(num_new_tokens, step.num_prefill_budget)
            # Positions past its known tokens: placeholders, drafts, and those of its plan in flight.
            num_lookahead = max(0, request.num_computed_tokens + num_new_tokens - num_tokens)
            block_ids = self._allocate_running(request, num_new_tokens, num_lookahead)
            if block_ids is not None:
                if is_chunk:
                    step.num_prefill_budget -= num_new_tokens
                step.add(request, num_new_tokens, block_ids, num_placeholders, drafts, num_draft_placeholders)
            else:
                is_blocked = True
            if request.status is RequestStatus.RUNNING:  # else it preempted itself and left the list
                i += 1
        if not is_blocked:
            self._admit_waiting(step)
        if not step.scheduled and not allow_empty:
            return None
        plan = StepPlan(
            step_id=self._next_step_id,
            scheduled=step.scheduled,
            new_requests=step.new_requests,
            finished_req_ids=self._finished_req_ids,
            after_step_id=after_step_id if step.has_placeholders else None,
            preempted_req_ids=self._preempted_req_ids,
            kv_connector_metadata=self._build_connector_meta(step) if self.connector is not None else None,
        )
        self._finished_req_ids = []
        self._preempted_req_ids = []
        self._in_flight[plan.step_id] = step.cohort
        self._next_step_id += 1
        return plan

    def update_from_output(
        self,
        plan: StepPlan,
        sampled_token_ids: dict[str, list[int]],
        kv_connector_output: KVConnectorOutput | None = None,
        draft_token_ids: dict[str, list[int]] | None = None,
    ) -> list[RequestUpdate]:
        """Apply one returned plan's sampled tokens and the KV connector's output merged over every stage.

        A request that verified drafts gets the accepted ones and one more token; `draft_token_ids`
        are the proposer's guesses for each sampled request's next step (speculative decoding).
        Returns an update per request that got tokens or finished.
        """
        if kv_connector_output is not None and self.connector is not None:
            self._update_from_connector(kv_connector_output)
            self._check_sync_loads(plan.step_id, kv_connector_output.invalid_block_ids)
        cohort = self._in_flight.get(plan.step_id)
        if cohort is None:
            raise ValueError(f"step {plan.step_id} is not in flight (unknown, or its output was already applied)")
        if len(cohort) != len(plan.scheduled):
            raise ValueError(f"step {plan.step_id}: plan does not match the one scheduled")
        if plan.after_step_id is not None and plan.after_step_id in self._in_flight:
            raise ValueError(f"step {plan.step_id} came back before step {plan.after_step_id}, the plan it follows")
        del self._in_flight[plan.step_id]
        updates = []
        step_id, has_connector, drafting = plan.step_id, self.connector is not None, self.draft_policy is not None
        for scheduled, request in zip(plan.scheduled, cohort):
            request.num_in_flight -= 1
            if request.status.is_finished:  # finished while in flight: its output is dropped
                if not request.is_in_flight and not self._holds_blocks(request):
                    self._forget(request)
                continue
            if request.void_step_id is not None and self._take_void(request, step_id):
                continue  # a continuation the plan before made void
            if has_connector and self._take_recompute(request):
                continue  # it read KV a load within a plan failed to bring: computed again
            if not scheduled.do_sample:  # a prompt chunk: nothing to report
                continue
            token_ids = sampled_token_ids.get(scheduled.request_id)
            if not token_ids:
                # A failed step: its KV is suspect. Roll back to its start (a plan continuing the
                # request after it computed garbage too: the caller must then finish the request).
                request.num_computed_tokens = scheduled.start_position
                request.num_placeholders = 0
                request.num_draft_tokens = 0
                request.draft_token_ids = []
                continue
            if drafting:
                self._apply_verification(request, step_id, scheduled, token_ids)
            if draft_token_ids is not None:
                request.draft_token_ids = draft_token_ids.get(scheduled.request_id) or []
            new_token_ids = []
            for token_id in token_ids:
                request.output_token_ids.append(token_id)
                if request.num_placeholders:  # the plan after this one computes this token
                    request.num_placeholders -= 1
                new_token_ids.append(token_id)
                if check_stop(request, self.max_model_len):
                    break  # tokens after a stop are dropped
            status = request.status
            if status.is_finished:
                self._release(request)
            stop_reason = request.stop_reason if isinstance(request.stop_reason, int) else None
            updates.append(RequestUpdate(request.request_id, new_token_ids, status.finish_reason, stop_reason))
        return updates

    def discard_failed_step(self, plan: StepPlan) -> list[str]:
        """A step some stage failed wrote no valid KV: its blocks leave the prefix cache. Returns the
        unfinished requests that must fail: the step's, and any other holding one of those blocks
        (it hit them meanwhile, so it read that KV; what it sent to a connector is not trusted)."""
        bad: set[int] = set()
        for scheduled in plan.scheduled:
            first_block = scheduled.start_position // self._block_manager.block_size
            bad.update(self._block_manager.uncache(scheduled.request_id, first_block))
        failed = [scheduled.request_id for scheduled in plan.scheduled]
        return failed + self._taint_holders(bad, set(failed))

    # ------------------------------------------------------------------ helpers
    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt tokens not scheduled yet: running requests' remaining chunks and the prompts of the
        waiting requests that could run next (at most `max_num_seqs`: a long queue costs nothing)."""
        waiting = itertools.islice(self._queues.waiting, self.max_num_seqs)
        num_tokens = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        for request in self._queues.running:
            num_left = request.num_tokens - request.num_computed_tokens
            if num_left > 1:
                num_tokens += num_left
        return num_tokens

    def _can_continue(self, request: Request, after_step_id: int | None, num_tokens: int) -> bool:
        """May an in-flight request (of `num_tokens` tokens) be scheduled in the plan after `after_step_id`?"""
        if request.void_step_id is not None:
            return False
        if request.num_computed_tokens < num_tokens:  # the next prompt chunk: its tokens are known
            # Async: in any plan, however many hold its earlier chunks (stages run plans in order).
            return self.async_scheduling or (request.num_in_flight == 1 and request.last_step_id == after_step_id)
        if request.num_in_flight != 1 or after_step_id is None or request.last_step_id != after_step_id:
            return False
        return self._outlives_plan_in_flight(request, num_tokens)

    def _outlives_plan_in_flight(self, request: Request, num_tokens: int) -> bool:
        """The tokens its plan in flight samples (its drafts, if all accepted, then one more) are its
        last unless stop checks finish it; do not compute a token after ones that finish it by
        length for sure."""
        num_new = request.num_draft_tokens + 1
        return (
            request.num_output_tokens + num_new < request.sampling_params.max_tokens
            and num_tokens + num_new < self.max_model_len
        )

    def _continue_decoding(self, request: Request, after_step_id: int, step: StepBuilder) -> bool:
        """The common step of async decoding, taken before the general path of `schedule`: a request
        in flight once, in plan `after_step_id`, every known token computed and no drafts, whose
        blocks already cover one more token, continues with one placeholder. Returns whether it did;
        otherwise nothing changed and the general path decides. Where both apply they give the
        same entry (tests/core/test_scheduler_decode_path.py)."""
        if (
            request.num_in_flight != 1
            or request.last_step_id != after_step_id
            or request.void_step_id is not None
            or request.draft_token_ids
            or request.num_draft_tokens
        ):
            return False
        num_tokens = request.num_tokens
        num_computed = request.num_computed_tokens
        if num_computed < num_tokens or not step.has_room or not self._outlives_plan_in_flight(request, num_tokens):
            return False
        block_ids = self._block_manager.covering_table(request.request_id, num_computed + 1, num_tokens)
        if block_ids is None:  # a new block (or one to hash, or preemption): the general path
            return False
        step.add(request, 1, block_ids, num_placeholders=1)
        return True

    def _release(self, request: Request) -> None:
        """Take a request that just got a finished status out of the queues and free its blocks.

        Blocks a KV transfer still reads or writes are freed once every stage has reported it.
        """
        self._queues.remove(request)
        request_id = request.request_id
        is_known = request_id in self._runner_known_ids
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(request, self._block_manager.block_ids(request_id))
            # Only a stage that knows the request can report its send: one never scheduled is freed now.
            if delay_free and is_known:
                self._hold(request)
                request.finished_kv_transfer_params = params  # a remote engine may pull the held blocks
            elif not delay_free:
                request.finished_kv_transfer_params = params
        if is_known:
            self._runner_known_ids.discard(request_id)
            self._finished_req_ids.append(request_id)
        self._release_blocks(request)

    def _forget(self, request: Request) -> None:
        if self.draft_policy is not None:
            self.draft_policy.forget(request.request_id)
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
            self._queues.forget(request.request_id)
            self._forget_transfers(request.request_id)
