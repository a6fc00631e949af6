"""`KVTransferScheduling`: the scheduler's KV-connector half, kept apart from batching policy.

State (set up by `_init_kv_transfer`): requests whose KV a connector loads
(`WAITING_FOR_REMOTE_KVS`, with the blocks each load fills), finished
requests whose blocks stay held for a send, block ids some stage failed to
load (until their load is complete on every stage), the requests preempted
while building the current plan, and a deadline per transfer. The
`Scheduler` calls these from admission (`_start_load`), plan building
(`_build_connector_meta`), `merge_kv_outputs` + `update_from_output`
(`_update_from_connector`) and `_release` / `_forget`.

The contract (see `asyncpp.kv_transfer.base` for the connector's):
* A waiting request's prefix beyond the engine's own cache hits may come
  from the connector. Loaded asynchronously, its blocks are allocated at
  once and the request waits in `WAITING_FOR_REMOTE_KVS` until the merged
  output (every stage) reports the load; then it queues again by arrival
  order with those tokens computed, less any from the first block that failed
  to load (recomputed, never used).
* Every plan carries the connector's metadata. A plan with no request is
  returned only when asked (`allow_empty`): the engine sends one to start
  transfers or to poll them while nothing else runs (`has_pending_transfers`).
* A finished request keeps its blocks while the connector still moves them
  (`request_finished` says so, or its load is in flight) until every stage
  has reported the transfer; its id stays taken until then. Each transfer
  has a deadline: past it, every stage aborts it (below).
* A request preempted while building a plan is named in its
  `preempted_req_ids`: stages finish its transfers before reusing its blocks.
* A request whose connector answers "ask again later" keeps its place in the
  queue; the requests behind it are admitted meanwhile.

The rule: **every block a transfer holds is released on every path.** A
request's blocks are freed once it is finished and neither loading nor held
for a send; loads and sends end only when every stage has reported them
(`KVOutputAggregator`, keyed by stage), and every stage reports each owed
transfer exactly once, failures included (`TransferLedger`). A transfer past
its deadline (`load_timeout_s` / `save_timeout_s` of the connector's
context) is aborted: the next plan names it (`aborted_req_ids`), every stage
stops it and reports it failed, a load's blocks are recomputed (or, with the
connector's `load_failure_policy` "fail", its request fails, saying so) and
a send's writes are not trusted. A send nobody will read (the token its params
carry ended the answer at a stop string) is aborted the same way at once
(`withdraw_send`). A connector that keeps answering "ask again later"
for a request is not asked again past `load_timeout_s` (its prefix is
computed), and never holds up the requests behind it. Once nothing is
pending, `has_pending_transfers` is False and the engine stops polling.

A read a stage could not stop may still write its blocks: the stage reports
them quarantined (`KVConnectorOutput.quarantined_block_ids`, no later than
the load it ends) and the block manager keeps them out of the free pool and
the prefix cache until that stage reports them released (meanwhile they
are a pending transfer: the engine polls, like blocks held for a send); a load whose
blocks are quarantined fails its request instead of being recomputed into
them. So that such a report is never too late, a request finished while its
load within a plan is in flight keeps its blocks until that plan is back.

A request that awaits its first token from a remote engine
(`Request.awaits_remote_tokens`, early prefill/decode handover) may load its
whole prompt, once that leaves every running request a free block to grow
into (`_has_room_to_await`); once loaded it is parked until the token comes
(`add_remote_tokens`), and it is never computed without it. A token that
does not come within `load_timeout_s` of the request's arrival fails it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from asyncpp.core.request import Request, RequestStatus
from asyncpp.kv_transfer.aggregator import KVOutputAggregator
from asyncpp.kv_transfer.base import KVConnectorScheduler, PlanInfo
from asyncpp.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput
from asyncpp.logging import get_logger

if TYPE_CHECKING:
    from asyncpp.core.request_queues import RequestQueues
    from asyncpp.core.step_builder import StepBuilder
    from asyncpp.kv.block_manager import BlockManager


class KVTransferScheduling:
    """Mixed into `Scheduler`, whose `_forget(request)` it calls."""

    _block_manager: BlockManager
    _queues: RequestQueues
    _next_step_id: int

    def _init_kv_transfer(self, connector: KVConnectorScheduler | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.connector = connector
        self._clock = clock
        self._waiting_for_remote: dict[str, Request] = {}  # loads in flight
        self._load_block_ids: dict[str, list[int]] = {}  # the blocks each load in flight fills
        self._load_ends: dict[str, int] = {}  # and the position it fills them up to
        self._invalid_block_ids: set[int] = set()  # reported by some stage, until their load completes
        self._held: dict[str, Request] = {}  # finished, blocks kept until every stage reported the send
        self._preempted_req_ids: list[str] = []  # for the next plan
        self._unsent_held: list[str] = []  # newly held, for the next plan
        self._unsent_aborted: list[str] = []  # past their deadline, for the next plan
        self._load_deadlines: dict[str, float] = {}
        self._load_timed_out: set[str] = set()  # loads aborted at their deadline, until they end
        self._send_deadlines: dict[str, float] = {}
        # Their merged send report counts as failed: timed out, or they read a failed step's KV.
        self._untrusted_sends: set[str] = set()
        self._asked_again_since: dict[str, float] = {}  # request -> first "ask again later"
        # Loads within a plan (the connector offered them synchronously): request -> (the plan
        # carrying the load, the blocks it fills), until that plan's output is back.
        self._sync_loads: dict[str, tuple[int, list[int]]] = {}
        self._failed_requests: list[tuple[str, str]] = []  # (request, why) for the engine to fail
        self._parked: dict[str, Request] = {}  # loaded, awaiting their remote first token
        self._token_deadlines: dict[str, float] = {}  # awaiting a remote first token, until then
        self._recompute_ids: set[str] = set()  # read KV a load within a plan failed to bring
        self.num_external_hit_tokens = 0  # loaded by the connector instead of computed
        self.num_failed_load_tokens = 0  # promised by the connector, failed to load, recomputed
        self.num_timed_out_transfers = 0
        self._aggregator: KVOutputAggregator | None = None
        if connector is not None:
            self._aggregator = KVOutputAggregator(connector.get_finished_count() or connector.ctx.pp_size)
            self.log = get_logger(role="engine")

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        return len(self._waiting_for_remote)

    @property
    def num_held_for_transfer(self) -> int:
        return len(self._held)

    @property
    def num_quarantined_blocks(self) -> int:
        """Blocks kept out of the free pool: a read into them could not be stopped (yet)."""
        return self._block_manager.num_quarantined_blocks

    @property
    def num_partly_reported_transfers(self) -> int:
        """Transfers some stages reported and others not yet."""
        return self._aggregator.num_pending() if self._aggregator is not None else 0

    def has_pending_loads(self) -> bool:
        """A request waits for a transfer (an async load), or one is still to be sent to the stages:
        worth polling for at once. Held blocks alone only wait to be freed."""
        return bool(
            self._waiting_for_remote
            or self._unsent_aborted
            or (self.connector is not None and self.connector.has_unsent_metadata())
        )

    def has_pending_transfers(self) -> bool:
        """KV transfers under way or waiting for a plan: the engine keeps sending plans until they end
        (quarantined blocks too: each plan looks again whether their reads ended)."""
        return bool(
            self._waiting_for_remote
            or self._held
            or self._block_manager.num_quarantined_blocks
            or self._token_deadlines
            or self._unsent_aborted
            or (self.connector is not None and self.connector.has_unsent_metadata())
        )

    def merge_kv_outputs(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One step's connector reports, `outputs[pp_rank]`, merged: a transfer ends when every stage
        reported it. Only transfers this scheduler waits for count."""
        merged = self._aggregator.aggregate(outputs, self._held.__contains__, self._is_loading)
        untrusted = merged.finished_sending & self._untrusted_sends
        if untrusted:
            self._untrusted_sends -= untrusted
            merged = dataclasses.replace(merged, failed_sending=merged.failed_sending | untrusted)
        return merged

    def _is_loading(self, request_id: str) -> bool:
        """Waited for by the scheduler: an async load, or a load within a plan not back yet (its
        report tells the connector the load has ended)."""
        return request_id in self._waiting_for_remote or request_id in self._sync_loads

    def _holds_blocks(self, request: Request) -> bool:
        """A transfer still uses its blocks: a send, an async load, or a load within a plan not back yet
        (a read the transport cannot stop is only known once that plan's output is)."""
        request_id = request.request_id
        return request_id in self._held or request_id in self._waiting_for_remote or request_id in self._sync_loads

    def _start_load(self, request: Request, token_ids: list[int], hit_block_ids: list[int], num_hit_tokens: int) -> bool | None:
        """Ask the connector for more of the prefix: True if the request now waits for an async load,
        None if the connector asks to be asked again later (the request keeps its place, others go)."""
        request_id = request.request_id
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if num_external is None:
            now = self._clock()
            since = self._asked_again_since.setdefault(request_id, now)
            if now - since < self.connector.ctx.load_timeout_s:
                return None
            self.log.warning(
                "kv_ask_again_timed_out", request_id=request_id, timeout_s=self.connector.ctx.load_timeout_s
            )  # fmt: skip
            num_external = 0  # computed instead
        self._asked_again_since.pop(request_id, None)
        if num_external <= 0:
            return False
        num_loaded_to = num_hit_tokens + num_external
        is_whole = num_external % self._block_manager.block_size == 0 or num_loaded_to == request.num_prompt_tokens
        # One that awaits its remote first token may load all it has: that token is computed next.
        num_left = len(token_ids) - num_loaded_to + (1 if request.awaits_remote_tokens else 0)
        if num_left < 1 or not is_whole or (request.awaits_remote_tokens and not load_async):
            raise ValueError(
                f"KV connector offered {num_external} tokens after {num_hit_tokens} of {len(token_ids)}: "
                "it must offer whole blocks (or end at the prompt's end) and leave at least one token to compute "
                "(a request awaiting its remote first token loads asynchronously)"
            )
        if request.awaits_remote_tokens and not self._has_room_to_await(num_hit_tokens, num_loaded_to):
            return None
        block_ids = self._block_manager.allocate_for_load(
            request_id, token_ids, num_hit_tokens, hit_block_ids, num_external
        )
        if block_ids is None:
            return False  # no room to load into: compute it instead (or wait for blocks like anyone)
        block_size = self._block_manager.block_size
        if not load_async:
            self._start_sync_load(request, block_ids, num_hit_tokens, num_external)
            return False
        self._queues.take_waiting(request)
        self._load_block_ids[request_id] = block_ids[num_hit_tokens // block_size :]
        self._load_ends[request_id] = num_loaded_to
        self._waiting_for_remote[request_id] = request
        self._load_deadlines[request_id] = self._clock() + self.connector.ctx.load_timeout_s
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_hit_tokens
            request.num_external_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        return True

    def _has_room_to_await(self, num_hit_tokens: int, num_loaded_to: int) -> bool:
        """Blocks for a prompt a remote engine is still computing, if every running request keeps one
        free block to grow into: a request waiting for its prefill (it cannot be preempted while it
        loads) must not take the blocks the decoding ones need next."""
        block_size = self._block_manager.block_size
        num_needed = -(-num_loaded_to // block_size) - num_hit_tokens // block_size
        return self._block_manager.num_free_blocks - num_needed >= len(self._queues.running)

    def _start_sync_load(self, request: Request, block_ids: list[int], num_hit_tokens: int, num_external: int) -> None:
        """A load within the plan being built: every stage finishes it before that plan's forward,
        so the request is computed from `num_hit_tokens + num_external` on at once (admission goes
        on with its blocks allocated). If the load fails, the request fails (`take_failed_requests`)."""
        block_size = self._block_manager.block_size
        self._sync_loads[request.request_id] = (self._next_step_id, block_ids[num_hit_tokens // block_size :])
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_hit_tokens
            request.num_external_tokens = num_external
        request.num_computed_tokens = num_hit_tokens  # as the connector sees it in both modes
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.num_computed_tokens += num_external
        self.num_external_hit_tokens += num_external

    def _check_sync_loads(self, step_id: int, invalid_block_ids: frozenset[int]) -> None:
        """The plan `step_id` is back: its synchronous loads either filled their blocks, or their
        requests (and any that hit those blocks meanwhile) fail."""
        for request_id, (load_step_id, block_ids) in list(self._sync_loads.items()):
            if load_step_id != step_id:
                continue
            del self._sync_loads[request_id]
            self._invalid_block_ids.difference_update(block_ids)  # reported for this load only
            bad = invalid_block_ids.intersection(block_ids)
            if bad:
                self._fail_sync_load(request_id, block_ids, len(bad))
            request = self._requests.get(request_id)  # type: ignore[attr-defined]
            if request is not None and request.is_finished:  # while its plan was in flight: its blocks
                self._release_blocks(request)  # go now (uncached if bad; quarantined ones stay out)

    def _fail_sync_load(self, request_id: str, block_ids: list[int], num_bad: int) -> None:
        """Its blocks leave the prefix cache; it and whoever hit them fail or start again (the policy)."""
        self.num_external_hit_tokens -= len(block_ids) * self._block_manager.block_size
        self.num_failed_load_tokens += len(block_ids) * self._block_manager.block_size
        policy = self.connector.load_failure_policy
        self.log.warning("kv_sync_load_failed", request_id=request_id, num_bad_blocks=num_bad, policy=policy)
        affected = self._discard_blocks(request_id, block_ids)
        if policy == "fail":
            why = f"KV connector failed to load {num_bad} of the {len(block_ids)} blocks of its prompt"
            self._failed_requests.extend((affected_id, why) for affected_id in affected)
        else:  # recomputed from scratch once no plan computing it is in flight
            self._recompute_ids.update(affected)
            self._untrusted_sends.update(affected)  # what they saved from that KV is not kept

    def _take_recompute(self, request: Request) -> bool:
        """The request read KV that never arrived (a failed load within a plan): drop what this
        plan computed for it and, once no plan of it is in flight, compute it again from scratch."""
        if request.request_id not in self._recompute_ids:
            return False
        if not request.is_in_flight:
            self._recompute_ids.discard(request.request_id)
            request.num_placeholders = 0
            self._preempt(request)  # type: ignore[attr-defined]
        return True

    def _discard_blocks(self, request_id: str, block_ids: list[int]) -> list[str]:
        """`block_ids` of the request hold no valid KV: they leave the prefix cache. Returns the
        unfinished requests that read them (this one included)."""
        table = self._block_manager.block_ids(request_id)
        first = min((table.index(b) for b in block_ids if b in table), default=len(table))
        bad = set(self._block_manager.uncache(request_id, first)) | set(block_ids)
        request = self._requests[request_id]  # type: ignore[attr-defined]
        return ([] if request.is_finished else [request_id]) + self._taint_holders(bad, {request_id})

    def _taint_holders(self, bad: set[int], skip: set[str]) -> list[str]:
        """Requests (but `skip`) holding one of the `bad` blocks read KV that was never written:
        what they sent is not trusted. Returns the unfinished ones, which must fail or start again."""
        tainted = []
        for request_id, request in self._requests.items():  # type: ignore[attr-defined]
            if request_id in skip or bad.isdisjoint(self._block_manager.block_ids(request_id)):
                continue
            self._untrusted_sends.add(request_id)
            if not request.is_finished:
                tainted.append(request_id)
        return tainted

    def take_failed_requests(self) -> list[tuple[str, str]]:
        """Requests whose KV load failed within a plan, with why: the engine fails them."""
        failed, self._failed_requests = self._failed_requests, []
        return failed

    def _hold(self, request: Request) -> None:
        """A finished request's blocks stay until every stage reports its send."""
        request_id = request.request_id
        self._held[request_id] = request
        self._unsent_held.append(request_id)
        self._send_deadlines[request_id] = self._clock() + self.connector.send_timeout_s

    def withdraw_send(self, request_id: str) -> None:
        """Nobody will read what a finished request's params hand out (its answer ended at the token
        they carry: a stop string): the next plan aborts its send on every stage, which frees its
        blocks once all have reported, not at the send deadline. Nothing if it is not held."""
        if request_id not in self._held:
            return
        self._send_deadlines.pop(request_id, None)
        if request_id not in self._unsent_aborted:
            self._unsent_aborted.append(request_id)

    def _build_connector_meta(self, step: StepBuilder) -> KVConnectorMetadata:
        self._expire_transfers()
        bm = self._block_manager
        scheduled = [(r, s.start_position, s.num_tokens) for r, s in zip(step.cohort, step.scheduled)]
        metadata = self.connector.build_connector_meta(
            PlanInfo(
                step_id=self._next_step_id,
                scheduled=scheduled,
                block_ids={s.request_id: s.block_ids for s in step.scheduled},
                block_hashes={s.request_id: bm.block_hashes(s.request_id) for s in step.scheduled},
                num_draft_tokens={s.request_id: s.num_draft_tokens for s in step.scheduled if s.num_draft_tokens},
            )
        )
        if self._unsent_held or self._unsent_aborted:
            metadata = dataclasses.replace(metadata, held_req_ids=self._unsent_held, aborted_req_ids=self._unsent_aborted)
            self._unsent_held, self._unsent_aborted = [], []
        return metadata

    def _expire_transfers(self) -> None:
        """Abort the transfers past their deadline: the plan being built tells every stage. Requests
        whose remote first token is past its deadline fail."""
        now = self._clock()
        for request_id in [r for r, deadline in self._token_deadlines.items() if now >= deadline]:
            del self._token_deadlines[request_id]
            timeout_s = self.connector.ctx.load_timeout_s
            self.log.warning("remote_first_token_timed_out", request_id=request_id, timeout_s=timeout_s)
            self._failed_requests.append((request_id, f"the remote prefill's first token did not come within {timeout_s} s"))
        for kind, deadlines in (("load", self._load_deadlines), ("send", self._send_deadlines)):
            for request_id in [r for r, deadline in deadlines.items() if now >= deadline]:
                del deadlines[request_id]
                if kind == "load":
                    self._invalid_block_ids.update(self._load_block_ids[request_id])  # none of them came
                    self._load_timed_out.add(request_id)
                else:
                    self._untrusted_sends.add(request_id)
                if request_id not in self._unsent_aborted:
                    self._unsent_aborted.append(request_id)
                self.num_timed_out_transfers += 1
                sending, recving = self._aggregator.reporters(request_id)
                self.log.warning(
                    "kv_transfer_timed_out", request_id=request_id, what=kind,
                    timeout_s=self.connector.ctx.load_timeout_s if kind == "load" else self.connector.send_timeout_s,
                    reported_pp_ranks=sorted(recving if kind == "load" else sending),
                )  # fmt: skip

    def _update_from_connector(self, output: KVConnectorOutput) -> None:
        # First: a stage reports a read it could not stop no later than the load it ends, so its
        # blocks are quarantined before that load's request frees them or computes into them.
        if output.quarantined_block_ids:
            self._block_manager.quarantine(output.quarantined_block_ids)
            self.log.error("kv_blocks_quarantined", block_ids=sorted(set(output.quarantined_block_ids)))
        if output.released_block_ids:
            if unknown := self._block_manager.release_quarantine(output.released_block_ids):
                self.log.warning("kv_release_of_unquarantined_blocks", block_ids=unknown)
            self.log.info("kv_blocks_released_from_quarantine", block_ids=sorted(set(output.released_block_ids)))
        self._invalid_block_ids |= output.invalid_block_ids
        self.connector.update_connector_output(output)
        for request_id in sorted(output.finished_recving):
            self._finish_load(request_id)
        for request_id in sorted(output.finished_sending):
            request = self._held.pop(request_id, None)
            self._send_deadlines.pop(request_id, None)
            if request is not None:
                self._release_blocks(request)

    def _finish_load(self, request_id: str) -> None:
        """Every stage loaded (or failed to load) the request's blocks: it may be scheduled again."""
        request = self._waiting_for_remote.pop(request_id, None)
        if request is None:
            return
        self._load_deadlines.pop(request_id, None)
        load_block_ids = self._load_block_ids.pop(request_id)
        load_end = self._load_ends.pop(request_id)
        num_loaded = next((i for i, b in enumerate(load_block_ids) if b in self._invalid_block_ids), len(load_block_ids))
        self._invalid_block_ids.difference_update(load_block_ids)
        is_timed_out = request_id in self._load_timed_out
        self._load_timed_out.discard(request_id)
        if request.is_finished:  # aborted while loading: its blocks go (quarantined ones stay out)
            self._release_blocks(request)
            return
        block_size = self._block_manager.block_size
        # A read into quarantined blocks may still write them: never compute into them, fail instead
        # (the engine frees its blocks; the quarantined ones stay out of the free pool).
        is_quarantined = any(self._block_manager.is_quarantined(b) for b in load_block_ids)
        if is_quarantined or (num_loaded < len(load_block_ids) and self.connector.load_failure_policy == "fail"):
            timeout_s = self.connector.ctx.load_timeout_s
            why = (f"KV connector did not load the KV of its prompt within load_timeout_s ({timeout_s} s)" if is_timed_out
                   else f"KV connector failed to load {len(load_block_ids) - num_loaded} of the {len(load_block_ids)} "
                        "blocks of its prompt")  # fmt: skip
            if is_quarantined:
                why += "; a read into its blocks could not be stopped (they are quarantined)"
            self.log.warning("kv_load_failed", request_id=request_id, timed_out=is_timed_out, policy="fail")
            self.num_failed_load_tokens += len(load_block_ids) * block_size
            self._failed_requests.append((request_id, why))  # in no queue: the engine fails it
            return
        # The last block may be partly filled (a load up to the prompt's end).
        num_loaded_tokens = min(num_loaded * block_size, load_end - request.num_computed_tokens)
        self.num_external_hit_tokens += num_loaded_tokens
        self.num_failed_load_tokens += (len(load_block_ids) - num_loaded) * block_size
        if num_loaded < len(load_block_ids):
            request.num_external_tokens = num_loaded_tokens  # the rest is recomputed
        request.num_computed_tokens += num_loaded_tokens
        if request.awaits_remote_tokens:
            self._parked[request_id] = request  # computed once its first token is here
            return
        request.status = RequestStatus.WAITING
        self._queues.requeue(request)

    def _await_remote_tokens(self, request: Request) -> None:
        """A new request that awaits its first token from a remote engine."""
        self._token_deadlines[request.request_id] = self._clock() + self.connector.ctx.load_timeout_s

    def add_remote_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """The first tokens of a request that awaited them (`ValueError` if it does not): computed from
        now on, once its KV is loaded."""
        request = self._requests.get(request_id)  # type: ignore[attr-defined]
        if request is None or request.is_finished:
            raise ValueError(f"request {request_id!r} is not running here")
        if not request.awaits_remote_tokens:
            raise ValueError(f"request {request_id!r} awaits no remote tokens")
        request.output_token_ids.extend(token_ids)
        request.awaits_remote_tokens = False
        self._token_deadlines.pop(request_id, None)
        if self._parked.pop(request_id, None) is not None:
            request.status = RequestStatus.WAITING
            self._queues.requeue(request)

    def _release_blocks(self, request: Request) -> None:
        """A finished request's blocks go once no transfer holds them; it is forgotten once nothing does.
        One still loading (aborted) has its load stopped by the next plan: it may wait for a remote
        engine that will never send (a prefill that ended too)."""
        if self._holds_blocks(request):
            request_id = request.request_id
            if request_id in self._waiting_for_remote and request_id not in self._unsent_aborted:
                self._load_deadlines.pop(request_id, None)
                self._unsent_aborted.append(request_id)
            return
        self._block_manager.free(request.request_id)
        if not request.is_in_flight:
            self._forget(request)  # type: ignore[attr-defined]

    def _forget_transfers(self, request_id: str) -> None:
        self._parked.pop(request_id, None)
        self._load_timed_out.discard(request_id)
        self._token_deadlines.pop(request_id, None)
        self._asked_again_since.pop(request_id, None)
        self._sync_loads.pop(request_id, None)
        self._recompute_ids.discard(request_id)
        self._untrusted_sends.discard(request_id)
        if self._aggregator is not None:
            self._aggregator.forget(request_id)
