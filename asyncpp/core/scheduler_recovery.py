"""Scheduling across a pipeline restart (`asyncpp.recovery`): every request computes its KV again.

Restarted stages hold no KV and know no request. So `recompute_all`:
* forgets every plan in flight, never applying it: the tokens it sampled
  reached no client (a plan's tokens are delivered only once it is back);
* puts every running request back in the waiting queue by arrival order,
  as a preemption does (`_requeue`), with the tokens it has delivered: its prompt
  and those tokens are then computed again as one prompt, and its next token
  is sampled where it left off. Greedy and seeded draws depend neither on the
  batch nor on how a prompt is chunked, nor on drafts (`RejectionSampler`),
  so it is the token an undisturbed run samples;
* empties the prefix cache (the KV behind its hashes is gone) and the list
  of requests the runner knows, so the first plan after the restart names
  no request the new stages never saw.
A request that finished while its plan was in flight is forgotten now. Plans
with a KV connector's transfers in flight cannot be undone here: the caller
does not restart such an engine (`RecoveryScheduling.can_recompute_all`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recompute:
    """What a restart costs the requests: how many go back to the queue, and the tokens they compute again."""

    num_requests: int
    num_tokens: int
    num_discarded_steps: int


class RecoveryScheduling:
    """Mixed into `Scheduler`: uses its queues, in-flight plans and block manager."""

    num_recomputed_requests: int = 0  # requeued by restarts, in all
    num_recomputed_tokens: int = 0  # their tokens whose KV was computed before and is again

    @property
    def can_recompute_all(self) -> bool:
        """Without a KV connector: nothing but the stages' own caches holds a request's KV."""
        return self.connector is None

    def recompute_all(self) -> Recompute:
        """Forget the plans in flight and requeue every running request to be computed again."""
        if not self.can_recompute_all:
            raise RuntimeError("recompute_all: a KV connector's transfers cannot be undone")
        num_discarded = len(self._in_flight)
        self._in_flight.clear()
        for request in list(self._requests.values()):
            request.num_in_flight = 0
            request.num_placeholders = 0
            request.num_draft_tokens = 0
            request.draft_token_ids = []
            request.void_step_id = None
            if request.is_finished:  # its late output will never come
                self._forget(request)
        running = list(self._queues.running)
        num_tokens = sum(r.num_computed_tokens for r in running)
        for request in running:  # by arrival order; a restart, not a preemption (no count, no stage told)
            self._requeue(request)
        self._preempted_req_ids = []  # the new stages never held the ones named before
        self._finished_req_ids = []
        self._runner_known_ids.clear()
        if not self._block_manager.reset_prefix_cache():
            num_used = self._block_manager.num_blocks - self._block_manager.num_free_blocks
            raise RuntimeError(f"recompute_all: {num_used} KV blocks still in use")
        self.num_recomputed_requests += len(running)
        self.num_recomputed_tokens += num_tokens
        return Recompute(len(running), num_tokens, num_discarded)
