"""`AdmissionScheduling`: who gets KV blocks, the scheduler's half that admits, allocates and preempts.

Mixed into `Scheduler`, whose docstring gives the policy (arrival order
everywhere; a running request short of blocks preempts the youngest idle
one, stalls, or preempts itself; liveness). `_allocate_running` grows a
running request's blocks, `_admit_waiting` admits waiting requests FCFS
into a plan, `_preempt` and `_requeue` send a request back to be computed
again (a preemption counts and is named to the stages; a restart's requeue,
`asyncpp.core.scheduler_recovery`, is neither).
"""

from __future__ import annotations

from asyncpp.core.plan import NewRequestData
from asyncpp.core.request import Request, RequestStatus
from asyncpp.core.step_builder import StepBuilder


class AdmissionScheduling:
    """Mixed into `Scheduler`: uses its block manager, queues, budgets and KV-connector half."""

    def _allocate_running(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> list[int] | None:
        """Get blocks for a running request, preempting younger ones as needed: its block table (a copy),
        or None if it must wait."""
        num_total_tokens = request.num_computed_tokens + num_new_tokens
        block_ids = self._block_manager.covering_table(request.request_id, num_total_tokens, request.num_tokens)
        if block_ids is not None:  # it holds the blocks already (most decode steps)
            return block_ids
        while True:
            block_ids = self._block_manager.allocate_slots(
                request.request_id,
                request.all_token_ids,
                num_new_tokens,
                request.num_computed_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
            )
            if block_ids is not None:
                return block_ids
            victim = self._queues.youngest_idle_running()
            if victim is not None and victim is not request:
                self._preempt(victim)
                continue
            # Every younger running request is in flight (or this one is, and cannot be preempted).
            if self._queues.running[-1] is not request or request.is_in_flight:
                return None  # stall; preempt one of them once it is back
            self._preempt(request)
            return None

    def _admit_waiting(self, step: StepBuilder) -> None:
        queues = self._queues
        num_skipped = 0  # at the head of `waiting`: their KV is on its way for another request
        while len(queues.waiting) > num_skipped and step.has_room and len(queues.running) < self.max_num_seqs:
            if self._block_manager.num_free_blocks == 0 or step.num_prefill_budget == 0:
                break  # a first allocation always needs a free block; skip the lookup (and its stats)
            request = queues.waiting[num_skipped]
            token_ids = request.all_token_ids
            has_blocks = self._block_manager.has_blocks(request.request_id)  # back from a KV load
            if has_blocks:
                hit_block_ids, num_hit_tokens = [], request.num_computed_tokens
            else:
                hit_block_ids, num_hit_tokens = self._block_manager.get_computed_blocks(token_ids)
                if self.connector is not None:
                    is_loading = self._start_load(request, token_ids, hit_block_ids, num_hit_tokens)
                    if is_loading is False and request.awaits_remote_tokens:
                        is_loading = None  # never computed before its remote first token: wait
                    if is_loading is None:  # its prefix is on its way for another request: it keeps
                        num_skipped += 1  # its place and is asked again next step; the rest go on
                        continue
                    if is_loading:
                        continue  # it left the queue to wait for its KV; the next one may go
                    if self._block_manager.has_blocks(request.request_id):  # loaded within this plan
                        has_blocks, hit_block_ids, num_hit_tokens = True, [], request.num_computed_tokens
            num_new_tokens = len(token_ids) - num_hit_tokens
            if num_new_tokens > step.num_budget_tokens and not self.enable_chunked_prefill:
                break
            num_new_tokens = min(num_new_tokens, step.num_budget_tokens, step.num_prefill_budget)
            block_ids = self._block_manager.allocate_slots(
                request.request_id, token_ids, num_new_tokens, num_hit_tokens, hit_block_ids
            )
            if block_ids is None:
                break  # FCFS: nobody behind it may take the blocks it waits for
            step.num_prefill_budget -= num_new_tokens
            queues.admit(request)
            if request.status is RequestStatus.WAITING and not has_blocks:  # first admission
                request.num_cached_tokens = num_hit_tokens
                if self.connector is not None:
                    self.connector.update_state_after_alloc(request, block_ids, 0)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            step.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                )
            )
            self._runner_known_ids.add(request.request_id)
            step.add(request, num_new_tokens, self._block_manager.block_ids(request.request_id))

    def _preempt(self, request: Request) -> None:
        """Recompute later (`_requeue`), counted as a preemption and named to the stages."""
        self._requeue(request)
        self._preempted_req_ids.append(request.request_id)
        request.num_preemptions += 1
        self._num_preemptions += 1

    def _requeue(self, request: Request) -> None:
        """Free its KV and put it back in the waiting queue by arrival order, to be computed again."""
        assert not request.is_in_flight, "an in-flight request's KV is being written"
        self._block_manager.free(request.request_id)
        self._queues.requeue(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
