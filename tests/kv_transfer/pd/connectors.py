"""Test connectors for the stage handshakes, registered on import
(`kv_transfer.module = "tests.kv_transfer.pd.connectors"`). Neither moves any KV.

* `handshake-recorder`: every stage publishes a `KVHandshakeMetadata` built
  from the caches it registered; the scheduler is PP-aware and keeps what it
  got (`handshakes`), answers `engine_handshake()` with it, and keeps the
  remote engines it is told about, refusing one whose id starts with
  "refuse" or is added twice. `stats()` shows both, so a launched engine's
  can be checked through `AsyncClient.stats()`.
* `handshake-plain`: the same stages, with the base class's handshake
  handling (not PP-aware): the one stage's metadata reaches
  `set_xfer_handshake_metadata`, more than one stage fails start-up.
"""

from __future__ import annotations

import torch

from asyncpp.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, PlanInfo
from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata, KVRegion
from asyncpp.kv_transfer.metadata import KVConnectorMetadata
from asyncpp.kv_transfer.registry import register_connector


class PublishingWorker(KVConnectorWorker):
    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset(), frozenset()

    def get_handshake_metadata(self) -> KVHandshakeMetadata:
        k, _ = self.kv_caches[self.start_layer]  # [num_blocks * block_size, heads, dim]
        block_size = self.ctx.block_size
        block_nbytes = block_size * k[0].numel() * k.element_size()
        regions = [
            KVRegion(layer, kind, cache.data_ptr(), cache.numel() * cache.element_size())
            for layer, kv in sorted(self.kv_caches.items())
            for kind, cache in zip("kv", kv)
        ]
        return KVHandshakeMetadata(
            self.pp_rank, 0, self.start_layer, self.end_layer, block_size, block_nbytes, self.ctx.dtype,
            num_blocks=k.shape[0] // block_size, agent_name=f"{self.ctx.engine_id}-stage{self.pp_rank}",
            agent_metadata=f"agent of stage {self.pp_rank}".encode(), regions=regions,
        )  # fmt: skip


class _NoTransfers(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class HandshakeRecorder(_NoTransfers):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.handshakes: dict[tuple[int, int], KVHandshakeMetadata] | None = None
        self.remote_engines: dict[str, EngineHandshake] = {}

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVHandshakeMetadata]) -> None:
        self.handshakes = dict(metadata)

    def engine_handshake(self) -> EngineHandshake:
        stages = [self.handshakes[key] for key in sorted(self.handshakes)]
        return EngineHandshake(self.ctx.engine_id, len(stages), stages)

    def add_remote_engine(self, handshake: EngineHandshake) -> None:
        if handshake.engine_id.startswith("refuse") or handshake.engine_id in self.remote_engines:
            raise ValueError(f"no thanks: {handshake.engine_id!r}")
        self.remote_engines[handshake.engine_id] = handshake

    def stats(self) -> dict:
        remote_layers = {e: [[s.start_layer, s.end_layer] for s in h.stages] for e, h in self.remote_engines.items()}
        return {"handshake_keys": sorted(self.handshakes or {}), "remote_engines": remote_layers}


class PlainScheduler(_NoTransfers):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.tp_handshakes: dict[int, KVHandshakeMetadata] | None = None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVHandshakeMetadata]) -> None:
        self.tp_handshakes = dict(metadata)


register_connector("handshake-recorder", HandshakeRecorder, PublishingWorker)
register_connector("handshake-plain", PlainScheduler, PublishingWorker)
