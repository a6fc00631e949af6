"""`KVTransferScheduling`: the scheduler's KV-connector half, kept apart from batching policy.

State (set up by `_init_kv_transfer`): requests whose KV a connector loads
(`WAITING_FOR_REMOTE_KVS`, with the blocks each load fills), finished
requests whose blocks stay held for a send, block ids some stage failed to
load (until their load is complete on every stage), and the requests
preempted while building the current plan. The `Scheduler` calls these from
admission (`_start_load`), plan building (`_build_connector_meta`) and
`update_from_output` (`_update_from_connector`); see its docstring for the
contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncpp.core.request import Request, RequestStatus
from asyncpp.kv_transfer.base import KVConnectorScheduler, PlanInfo
from asyncpp.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from asyncpp.core.request_queues import RequestQueues
    from asyncpp.core.step_builder import StepBuilder
    from asyncpp.kv.block_manager import BlockManager


class KVTransferScheduling:
    _block_manager: "BlockManager"
    _queues: "RequestQueues"
    _next_step_id: int

    def _init_kv_transfer(self, connector: KVConnectorScheduler | None) -> None:
        self.connector = connector
        self._waiting_for_remote: dict[str, Request] = {}  # loads in flight
        self._load_block_ids: dict[str, list[int]] = {}  # the blocks each load in flight fills
        self._invalid_block_ids: set[int] = set()  # reported by some stage, until their load completes
        self._held: dict[str, Request] = {}  # finished, blocks kept until every stage reported the send
        self._preempted_req_ids: list[str] = []  # for the next plan
        self.num_external_hit_tokens = 0  # loaded by the connector instead of computed
        self.num_failed_load_tokens = 0  # promised by the connector, failed to load, recomputed

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        return len(self._waiting_for_remote)

    @property
    def num_held_for_transfer(self) -> int:
        return len(self._held)

    def has_pending_transfers(self) -> bool:
        """KV transfers under way or waiting for a plan: the engine keeps sending plans until they end."""
        return bool(
            self._waiting_for_remote
            or self._held
            or (self.connector is not None and self.connector.has_unsent_metadata())
        )

    def _holds_blocks(self, request: Request) -> bool:
        return request.request_id in self._held or request.request_id in self._waiting_for_remote

    def _start_load(self, request: Request, token_ids: list[int], hit_block_ids: list[int], num_hit_tokens: int) -> bool | None:
        """Ask the connector for more of the prefix: True if the request now waits for an async load,
        None if the connector asks to be asked again later (admission stops for this step)."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if num_external is None:
            return None
        if num_external <= 0:
            return False
        if not load_async:
            raise NotImplementedError(
                f"KV connector {type(self.connector).__name__} offered a synchronous load; "
                "only asynchronous loads are supported"
            )
        if num_hit_tokens + num_external >= len(token_ids) or num_external % self._block_manager.block_size:
            raise ValueError(
                f"KV connector offered {num_external} tokens after {num_hit_tokens} of {len(token_ids)}: "
                "it must offer whole blocks and leave at least one token to compute"
            )
        block_ids = self._block_manager.allocate_for_load(
            request.request_id, token_ids, num_hit_tokens, hit_block_ids, num_external
        )
        if block_ids is None:
            return False  # no room to load into: compute it instead (or wait for blocks like anyone)
        self._queues.waiting.popleft()
        block_size = self._block_manager.block_size
        self._load_block_ids[request.request_id] = block_ids[num_hit_tokens // block_size :]
        self._waiting_for_remote[request.request_id] = request
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_hit_tokens
            request.num_external_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        return True

    def _build_connector_meta(self, step: StepBuilder) -> KVConnectorMetadata:
        bm = self._block_manager
        scheduled = [(r, s.start_position, s.num_tokens) for r, s in zip(step.cohort, step.scheduled)]
        return self.connector.build_connector_meta(
            PlanInfo(
                step_id=self._next_step_id,
                scheduled=scheduled,
                block_ids={s.request_id: s.block_ids for s in step.scheduled},
                block_hashes={s.request_id: bm.block_hashes(s.request_id) for s in step.scheduled},
            )
        )

    def _update_from_connector(self, output: KVConnectorOutput) -> None:
        self._invalid_block_ids |= output.invalid_block_ids
        self.connector.update_connector_output(output)
        for request_id in sorted(output.finished_recving):
            self._finish_load(request_id)
        for request_id in sorted(output.finished_sending):
            request = self._held.pop(request_id, None)
            if request is not None:
                self._block_manager.free(request_id)
                if not request.is_in_flight:
                    self._forget(request)

    def _finish_load(self, request_id: str) -> None:
        """Every stage loaded (or failed to load) the request's blocks: it may be scheduled again."""
        request = self._waiting_for_remote.pop(request_id, None)
        if request is None:
            return
        load_block_ids = self._load_block_ids.pop(request_id)
        num_loaded = next((i for i, b in enumerate(load_block_ids) if b in self._invalid_block_ids), len(load_block_ids))
        self._invalid_block_ids.difference_update(load_block_ids)
        if request.is_finished:  # aborted while loading: nobody writes its blocks any more
            self._block_manager.free(request_id)
            if not request.is_in_flight:
                self._forget(request)
            return
        block_size = self._block_manager.block_size
        num_loaded_tokens = num_loaded * block_size
        self.num_external_hit_tokens += num_loaded_tokens
        self.num_failed_load_tokens += (len(load_block_ids) - num_loaded) * block_size
        if num_loaded < len(load_block_ids):
            request.num_external_tokens = num_loaded_tokens  # the rest is recomputed
        request.num_computed_tokens += num_loaded_tokens
        request.status = RequestStatus.WAITING
        self._queues.requeue(request)

