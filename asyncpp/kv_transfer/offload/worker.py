"""Worker side of the offload connector: one stage's store, and a thread that moves its blocks.

Loads and saves run on one transfer thread per stage, in submission order,
off the step's critical path (the copies release the GIL). Why the blocks
they touch stay put meanwhile:
* a load fills blocks of a request the engine does not schedule (nor let
  any other request hit in its prefix cache) until every stage reported it;
* a save reads full blocks of a scheduled request after this stage's
  forward wrote them. The engine keeps a finished request's blocks until it
  is reported here (`finished_sending`, once the request is in
  `finished_req_ids` and its saves are done), and a preempted request's
  blocks, freed at once, are reused only by a later plan, whose
  `pre_forward` first waits for its saves (`handle_preemptions`).
A record that is missing, truncated or corrupted (header and checksum are
checked) is a miss: its block id is reported as failed, and the engine
recomputes it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from asyncpp.dtypes import torch_dtype
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorWorker
from asyncpp.kv_transfer.metadata import BlockTransfer, KVTransferStats
from asyncpp.kv_transfer.offload.blocks import gather_blocks, scatter_blocks
from asyncpp.kv_transfer.offload.layout import shm_name, stage_dir, stage_layouts
from asyncpp.kv_transfer.offload.store import BlockStore, DirBlockStore, ShmBlockStore
from asyncpp.logging import get_logger


@dataclass(frozen=True)
class _Done:
    """What one transfer job did."""

    num_blocks: int
    num_bytes: int
    duration_s: float
    failed_block_ids: tuple[int, ...] = ()


class OffloadWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, pp_rank: int) -> None:
        super().__init__(ctx, pp_rank)
        self.layout = stage_layouts(ctx)[pp_rank]
        self.store: BlockStore = (
            ShmBlockStore(shm_name(ctx, pp_rank), self.layout, create=True)
            if ctx.store == "shm"
            else DirBlockStore(stage_dir(ctx, pp_rank), self.layout)
        )
        self.log = get_logger(role="kv_connector", connector="offload", pp_rank=pp_rank)
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-offload-{pp_rank}")
        self._loads: dict[str, tuple[BlockTransfer, Future]] = {}
        self._saves: dict[str, list[Future]] = {}  # request -> its save jobs not collected yet
        self._has_saved: set[str] = set()  # requests with saves, until reported finished sending
        self._finished: set[str] = set()  # of those, the ones the engine has finished
        self._failed_block_ids: set[int] = set()
        self._stats = KVTransferStats()  # since the last report

    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = sorted(kv_caches)
        if layers != list(range(self.start_layer, self.end_layer)):
            raise ValueError(f"stage {self.pp_rank} owns layers {self.start_layer}..{self.end_layer}, got {layers}")
        self._kv_caches = [kv_caches[layer] for layer in layers]
        dtype = self._kv_caches[0][0].dtype
        if dtype != torch_dtype(self.layout.dtype):
            raise ValueError(f"KV cache dtype {dtype} but the store's is {self.layout.dtype}")

    # ---- per step -------------------------------------------------------------------------
    def start_load_kv(self, step_id: int) -> None:
        for load in self.metadata.loads:
            self.log.info("kv_load_started", step_id=step_id, request_id=load.request_id, num_blocks=len(load.block_ids))
            self._loads[load.request_id] = (load, self._thread.submit(self._load, load, step_id))

    def save_kv(self, step_id: int) -> None:
        for save in self.metadata.saves:
            self.log.debug("kv_save_started", step_id=step_id, request_id=save.request_id, num_blocks=len(save.block_ids))
            self._saves.setdefault(save.request_id, []).append(self._thread.submit(self._save, save, step_id))
            self._has_saved.add(save.request_id)

    def handle_preemptions(self, preempted_req_ids: list[str]) -> None:
        for request_id in preempted_req_ids:
            for job in self._saves.get(request_id, ()):
                job.result()  # their blocks are about to be reused

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        finished_recving = set()
        for request_id, (load, job) in list(self._loads.items()):
            if job.done():
                del self._loads[request_id]
                finished_recving.add(request_id)
                if not self._collect(job, "load"):
                    self._failed_block_ids.update(load.block_ids)  # nothing it loaded can be trusted
        for request_id, jobs in list(self._saves.items()):
            for job in [j for j in jobs if j.done()]:
                jobs.remove(job)
                self._collect(job, "save")
            if not jobs:
                del self._saves[request_id]
        self._finished |= finished_req_ids & self._has_saved
        finished_sending = {r for r in self._finished if r not in self._saves}
        self._finished -= finished_sending
        self._has_saved -= finished_sending
        return frozenset(finished_sending), frozenset(finished_recving)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return frozenset(failed)

    def get_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        return stats

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.store.close()
        if isinstance(self.store, ShmBlockStore):
            self.store.unlink()

    # ---- on the transfer thread -----------------------------------------------------------
    def _load(self, load: BlockTransfer, step_id: int) -> _Done:
        t0 = time.perf_counter()
        payload = torch.empty((len(load.block_ids), *self.layout.payload_shape), dtype=torch_dtype(self.layout.dtype))
        good, failed = [], []
        for i, (block_hash, slot) in enumerate(zip(load.block_hashes, load.slots)):
            reason = self.store.read_into(slot, block_hash, payload[i])
            if reason is None:
                good.append(i)
            else:
                failed.append(load.block_ids[i])
                self.log.warning(
                    "kv_load_miss", step_id=step_id, request_id=load.request_id, slot=slot,
                    block_hash=block_hash.hex()[:16], reason=reason,
                )
        if good:
            scatter_blocks(self._kv_caches, [load.block_ids[i] for i in good], self.layout.block_size, payload[good])
        done = _Done(len(good), len(good) * self.layout.payload_nbytes, time.perf_counter() - t0, tuple(failed))
        self.log.info(
            "kv_load_finished", step_id=step_id, request_id=load.request_id, num_blocks=done.num_blocks,
            num_failed_blocks=len(failed), duration_ms=round(done.duration_s * 1e3, 3),
        )
        return done

    def _save(self, save: BlockTransfer, step_id: int) -> _Done:
        t0 = time.perf_counter()
        payload = gather_blocks(self._kv_caches, save.block_ids, self.layout.block_size)
        for i, (block_hash, slot) in enumerate(zip(save.block_hashes, save.slots)):
            self.store.write(slot, block_hash, payload[i])
        done = _Done(len(save.block_ids), len(save.block_ids) * self.layout.payload_nbytes, time.perf_counter() - t0)
        self.log.debug(
            "kv_save_finished", step_id=step_id, request_id=save.request_id, num_blocks=done.num_blocks,
            duration_ms=round(done.duration_s * 1e3, 3),
        )
        return done

    def _collect(self, job: Future, kind: str) -> bool:
        """Account for a finished job; False if it raised."""
        try:
            done: _Done = job.result()
        except Exception as e:  # noqa: BLE001 - a failed save leaves its slots unverifiable: loads check them
            self.log.error(f"kv_{kind}_failed", error=repr(e))
            return False
        self._failed_block_ids.update(done.failed_block_ids)
        add = (
            KVTransferStats(num_blocks_loaded=done.num_blocks, num_bytes_loaded=done.num_bytes, load_time_s=done.duration_s)
            if kind == "load"
            else KVTransferStats(num_blocks_saved=done.num_blocks, num_bytes_saved=done.num_bytes, save_time_s=done.duration_s)
        )
        self._stats = self._stats + add
        return True
