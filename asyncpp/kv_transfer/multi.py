"""The `multi` connector: several connectors as one (`kv_transfer.children`, in load order).

* Loads: the first child that offers tokens for a request loads them; the
  others are told it has no external tokens.
* Saves: every child builds its own saves; each transfer in the shared
  metadata carries its child's index (`connector_index`) and every stage
  hands each child only its own.
* A finished request's blocks are kept while any child asks for that; the
  plan that tells the stages it finished also names those children
  (`send_holders`), and a stage reports it finished sending only once each
  of them has (then, as always, the engine waits for every stage).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from asyncpp.kv_transfer.base import (
    ConnectorContext,
    KVConnectorScheduler,
    KVConnectorWorker,
    PlanInfo,
)
from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata
from asyncpp.kv_transfer.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferStats,
)
from asyncpp.kv_transfer.registry import connector_classes, register_connector

if TYPE_CHECKING:
    from asyncpp.core.request import Request


class MultiScheduler(KVConnectorScheduler):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.children = [connector_classes(c.name)[0](c) for c in ctx.children]
        self._unsent_holders: dict[str, list[int]] = {}  # finished request -> children keeping its blocks

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._first_offer(request, num_computed_tokens)[1:]

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        # The child that offered them (asking again has no side effects, and gives the same answer).
        loader = self._first_offer(request, request.num_computed_tokens)[0] if num_external_tokens else None
        for index, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if index == loader else 0)

    def _first_offer(self, request: Request, num_computed_tokens: int) -> tuple[int | None, int | None, bool]:
        """(index of the first child offering tokens, its offer); (None, None, False): ask again later."""
        for index, child in enumerate(self.children):
            num_tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:
                return None, None, False  # ask again later, as that child asks
            if num_tokens > 0:
                return index, num_tokens, load_async
        return None, 0, False

    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        loads, saves = [], []
        for index, child in enumerate(self.children):
            meta = child.build_connector_meta(plan)
            loads += [dataclasses.replace(t, connector_index=index) for t in meta.loads]
            saves += [dataclasses.replace(t, connector_index=index) for t in meta.saves]
        holders, self._unsent_holders = self._unsent_holders, {}
        return KVConnectorMetadata(loads, saves, holders)

    def has_unsent_metadata(self) -> bool:
        return any(child.has_unsent_metadata() for child in self.children)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for child in self.children:  # each ignores the requests it does not know
            child.update_connector_output(output)

    @property
    def can_forget_transfers(self) -> bool:  # type: ignore[override]
        return all(child.can_forget_transfers for child in self.children)

    @property
    def generation(self) -> int:  # type: ignore[override]
        return max(child.generation for child in self.children)

    def forget_transfers(self) -> None:
        for child in self.children:
            child.forget_transfers()
        self._unsent_holders.clear()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        holders, params = [], {}
        for index, child in enumerate(self.children):
            child_delay, child_params = child.request_finished(request, block_ids)
            if child_delay:
                holders.append(index)
            if child_params:
                params[str(index)] = child_params
        if holders:
            self._unsent_holders[request.request_id] = holders
        return bool(holders), params or None

    @property
    def load_failure_policy(self) -> str:  # type: ignore[override]
        """"fail" if any child fails its requests on a failed load within a plan."""
        return "fail" if any(child.load_failure_policy == "fail" for child in self.children) else "recompute"

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVHandshakeMetadata]) -> None:
        """Every child gets every stage's handshake (one that is not PP-aware refuses pp_rank > 0)."""
        for child in self.children:
            child.set_xfer_handshake_metadata_pp_aware(metadata)

    def validate_kv_transfer_params(self, params: dict[str, Any], prompt_token_ids: list[int]) -> None:
        """Taken if some child takes them (the first child's complaint otherwise)."""
        errors = []
        for child in self.children:
            try:
                return child.validate_kv_transfer_params(params, prompt_token_ids)
            except (TypeError, ValueError) as e:
                errors.append(e)
        raise errors[0]

    def claim_kv_transfer_params(self, params: dict[str, Any]) -> None:
        for child in self.children:  # each claims only its own params
            child.claim_kv_transfer_params(params)

    def remote_output_token_ids(self, params: dict[str, Any]) -> list[int]:
        """The first child's that names any (the one that took the params)."""
        return next((ids for child in self.children if (ids := child.remote_output_token_ids(params))), [])

    def awaits_remote_prefill(self, params: dict[str, Any]) -> bool:
        return any(child.awaits_remote_prefill(params) for child in self.children)

    def accept_remote_prefill(self, request: Request, params: dict[str, Any]) -> list[int]:
        """The child's that awaits it."""
        for child in self.children:
            if request.kv_transfer_params is not None and child.awaits_remote_prefill(request.kv_transfer_params):
                return child.accept_remote_prefill(request, params)
        raise ValueError("no KV connector awaits a remote prefill for this request")

    def engine_handshake(self) -> EngineHandshake | None:
        handshakes = [h for child in self.children if (h := child.engine_handshake()) is not None]
        return handshakes[0] if handshakes else None

    def add_remote_engine(self, handshake: EngineHandshake) -> None:
        """Every child that moves KV between engines gets it; refused if none does."""
        errors, num_added = [], 0
        for child in self.children:
            try:
                child.add_remote_engine(handshake)
                num_added += 1
            except ValueError as e:
                errors.append(e)
        if not num_added:
            raise errors[0]

    def stats(self) -> dict[str, Any]:
        return {f"child{i}_{k}": v for i, child in enumerate(self.children) for k, v in child.stats().items()}

    def close(self) -> None:
        for child in self.children:
            child.close()


class MultiWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, pp_rank: int) -> None:
        super().__init__(ctx, pp_rank)
        self.children = [connector_classes(c.name)[1](c, pp_rank) for c in ctx.children]
        self._owing_send: dict[str, set[int]] = {}  # held request -> children keeping it, not reported yet
        self._failed_send: set[str] = set()  # some child failed its send (until the request is reported)
        self._finished_sending_failed: set[str] = set()  # of the latest finished_sending

    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for child in self.children:
            child.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        held = set(metadata.held_req_ids)
        for request_id, holders in metadata.send_holders.items():
            if request_id in held:  # the engine waits for it (it knows the request was scheduled)
                self._owing_send[request_id] = set(holders)
        for index, child in enumerate(self.children):
            child.bind_connector_metadata(
                KVConnectorMetadata(
                    [t for t in metadata.loads if t.connector_index == index],
                    [t for t in metadata.saves if t.connector_index == index],
                    held_req_ids=[r for r in metadata.held_req_ids if index in self._owing_send.get(r, ())],
                )
            )

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.children:
            child.clear_connector_metadata()

    def start_load_kv(self, step_id: int) -> None:
        for child in self.children:
            child.start_load_kv(step_id)

    def save_kv(self, step_id: int) -> None:
        for child in self.children:
            child.save_kv(step_id)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def handle_preemptions(self, preempted_req_ids: list[str]) -> None:
        for child in self.children:
            child.handle_preemptions(preempted_req_ids)

    def abort_transfers(self, request_ids: list[str]) -> None:
        for child in self.children:
            child.abort_transfers(request_ids)
        for request_id in request_ids:  # the wrapper reports them
            self._owing_send.pop(request_id, None)
            self._failed_send.discard(request_id)

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        finished_sending, finished_recving = set(), set()
        for index, child in enumerate(self.children):
            sending, recving = child.get_finished(finished_req_ids)
            finished_recving |= recving
            failed = child.get_failed_sending()
            for request_id in sending:
                owing = self._owing_send.get(request_id)
                if owing is None:
                    continue  # not kept for this child (the engine never asked to wait for it)
                if request_id in failed:
                    self._failed_send.add(request_id)
                owing.discard(index)
                if not owing:
                    del self._owing_send[request_id]
                    finished_sending.add(request_id)
        self._finished_sending_failed = finished_sending & self._failed_send
        self._failed_send -= finished_sending
        return frozenset(finished_sending), frozenset(finished_recving)

    def get_failed_sending(self) -> frozenset[str]:
        failed, self._finished_sending_failed = self._finished_sending_failed, set()
        return frozenset(failed)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return frozenset().union(*(child.get_block_ids_with_load_errors() for child in self.children))

    def get_quarantined_blocks(self) -> tuple[list[int], list[int]]:
        quarantined, released = [], []
        for child in self.children:
            q, r = child.get_quarantined_blocks()
            quarantined += q
            released += r
        return quarantined, released

    def get_handshake_metadata(self) -> KVHandshakeMetadata | None:
        """The one child's that publishes a transfer endpoint (a stage has one)."""
        published = [md for child in self.children if (md := child.get_handshake_metadata()) is not None]
        if len(published) > 1:
            raise ValueError(f"{len(published)} children of the multi connector publish handshake metadata; one may")
        return published[0] if published else None

    def get_stats(self) -> KVTransferStats:
        total = KVTransferStats()
        for child in self.children:
            total = total + child.get_stats()
        return total

    def close(self) -> None:
        for child in self.children:
            child.close()


register_connector("multi", MultiScheduler, MultiWorker)
