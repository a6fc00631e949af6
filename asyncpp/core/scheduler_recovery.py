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
A request that finished while its plan was in flight is forgotten now.

With a KV connector, the transfers died with the stages, unreported
(`_drop_transfers`): a finished request held for its sends is freed and
forgotten (what it saved is not trusted: the connector frees those slots); a
request waiting for a load goes back to the queue like a running one; blocks
quarantined for a read that could not be stopped are released (the reading
stage is gone). The connector forgets its side (`forget_transfers`) and keeps
what outlives a stage: a requeued request then loads its prefix from the
offload store instead of computing it. A connector that cannot (the default)
keeps the engine from restarting (`RecoveryScheduling.can_recompute_all`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncpp.core.request import Request


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
        """Nothing but the stages' own caches holds a request's KV, or the KV connector can forget the
        transfers that die with the stages."""
        return self.connector is None or self.connector.can_forget_transfers

    def recompute_all(self) -> Recompute:
        """Forget the plans in flight and requeue every running request to be computed again."""
        if not self.can_recompute_all:
            raise RuntimeError("recompute_all: a KV connector's transfers cannot be undone")
        num_discarded = len(self._in_flight)
        self._in_flight.clear()
        for request in self._requests.values():
            request.num_in_flight = 0
            request.num_placeholders = 0
            request.num_draft_tokens = 0
            request.draft_token_ids = []
            request.void_step_id = None
        loading = self._drop_transfers() if self.connector is not None else []
        for request in list(self._requests.values()):
            if request.is_finished:  # its late output will never come
                self._block_manager.free(request.request_id)
                self._forget(request)
        running = list(self._queues.running) + loading
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

    def _drop_transfers(self) -> list[Request]:
        """Every transfer in flight ended with the stages: forget them here and in the connector.
        Returns the requests that waited for a load (unfinished), to be queued again."""
        self.connector.forget_transfers()
        loading = [r for r in [*self._waiting_for_remote.values(), *self._parked.values()] if not r.is_finished]
        for table in (self._waiting_for_remote, self._parked, self._held, self._load_block_ids, self._load_ends,
                      self._load_deadlines, self._send_deadlines, self._sync_loads):  # fmt: skip
            table.clear()
        for ids in (self._invalid_block_ids, self._load_timed_out, self._untrusted_sends, self._recompute_ids):
            ids.clear()
        self._unsent_held, self._unsent_aborted = [], []
        self._block_manager.release_every_quarantine()
        self._aggregator.forget_all()
        return loading
