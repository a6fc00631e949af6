"""Worker side of the offload connector: one stage's store, and a thread that moves its blocks.

Loads and saves run on one transfer thread per stage, in submission order,
off the step's critical path (`BlockMover`: whole block runs per call, the
copies release the GIL; on CUDA through pinned staging on a side stream).
Why the blocks they touch stay put meanwhile:
* a load fills blocks of a request the engine does not schedule (nor let
  any other request hit in its prefix cache) until every stage reported it;
* a save reads full blocks of a scheduled request after this stage's
  forward wrote them (on CUDA it waits for an event recorded after that
  forward). The engine keeps a finished request's blocks until it is
  reported here (`finished_sending`, once the request is in `held_req_ids`
  and its saves are done), and a preempted request's blocks, freed at once,
  are reused only by a later plan, whose `pre_forward` first waits for its
  saves (`handle_preemptions`, at most `save_timeout_s`, then aborts them).
Every job touches the cache only through its guard (`_Job.cache_access`):
`abort_transfers` cancels a job under that lock, so once it returns the job
never touches the cache again, wherever its thread is stuck. A record that
is missing, truncated or corrupted (header and checksum are checked) is a
miss: its block id is reported as failed, and the engine recomputes it. A
save that raised, was cancelled or never ran makes its request's send fail
(`failed_sending`): the engine then drops its slots instead of marking them
loadable.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from asyncpp.dtypes import torch_dtype
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorWorker
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVTransferStats
from asyncpp.kv_transfer.offload.layout import shm_name, stage_dir, stage_layouts
from asyncpp.kv_transfer.offload.mover import BlockMover, TransferCancelled
from asyncpp.kv_transfer.offload.store import BlockStore, DirBlockStore, ShmBlockStore
from asyncpp.logging import get_logger, is_debug_enabled


@dataclass
class _Job:
    """One load, or one step's saves, on the transfer thread, cancellable between its touches of the cache."""

    transfers: list[BlockTransfer]
    step_id: int
    future: Future | None = None
    is_cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def request_ids(self) -> set[str]:
        return {t.request_id for t in self.transfers}

    def joined(self) -> tuple[list[int], list[bytes], list[int]]:
        """(block ids, block hashes, slots) of all its transfers, in order."""
        return (
            [b for t in self.transfers for b in t.block_ids],
            [h for t in self.transfers for h in t.block_hashes],
            [s for t in self.transfers for s in t.slots],
        )

    @contextlib.contextmanager
    def cache_access(self) -> Iterator[None]:
        with self.lock:
            if self.is_cancelled:
                raise TransferCancelled(f"step {self.step_id}: transfer of {sorted(self.request_ids)} aborted")
            yield

    def cancel(self) -> None:
        """Waits for a copy under way to end: afterwards the job never touches the cache."""
        with self.lock:
            self.is_cancelled = True


class OffloadWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, pp_rank: int) -> None:
        super().__init__(ctx, pp_rank)
        self.layout = stage_layouts(ctx)[pp_rank]
        self.store: BlockStore = (
            ShmBlockStore.create_or_adopt(shm_name(ctx, pp_rank), self.layout)
            if ctx.store == "shm"
            else DirBlockStore(stage_dir(ctx, pp_rank), self.layout)
        )
        if isinstance(self.store, ShmBlockStore):
            self.store.prefault()  # at start-up, not in the first saves while serving
        self.log = get_logger(role="kv_connector", connector="offload", pp_rank=pp_rank)
        self._is_debug = is_debug_enabled(self.log)
        self.mover: BlockMover | None = None
        self._is_cuda = False
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-offload-{pp_rank}")
        self._loads: dict[str, _Job] = {}
        # Save jobs not collected yet, one per step (a step's saves move in one call: a job's fixed
        # cost, not the bytes, dominates a decode step's few blocks).
        self._save_jobs: list[_Job] = []
        self._held: set[str] = set()  # the engine waits for their sends: report once saves are done
        self._failed_saves: set[str] = set()  # some save of theirs failed, was cancelled or skipped
        self._finished_sending_failed: set[str] = set()  # of the latest finished_sending
        self._failed_block_ids: set[int] = set()
        self._stats = KVTransferStats()  # since the last report

    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = sorted(kv_caches)
        if layers != list(range(self.start_layer, self.end_layer)):
            raise ValueError(f"stage {self.pp_rank} owns layers {self.start_layer}..{self.end_layer}, got {layers}")
        caches = [kv_caches[layer] for layer in layers]
        dtype = caches[0][0].dtype
        if dtype != torch_dtype(self.layout.dtype):
            raise ValueError(f"KV cache dtype {dtype} but the store's is {self.layout.dtype}")
        self.mover = BlockMover(caches, self.layout.block_size, self.store)  # refuses what it cannot move
        self._is_cuda = caches[0][0].device.type == "cuda"

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    @property
    def num_saves_in_flight(self) -> int:
        """Save jobs (one per step with saves) not collected yet."""
        return len(self._save_jobs)

    @property
    def is_idle(self) -> bool:
        """Nothing moving, and no finished request waiting for its report."""
        return not (self._loads or self._save_jobs or self._held)

    # ---- per step -------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        self._held.update(metadata.held_req_ids)

    def start_load_kv(self, step_id: int) -> None:
        for load in self.metadata.loads:
            self.log.info("kv_load_started", step_id=step_id, request_id=load.request_id, num_blocks=len(load.block_ids))
            job = _Job([load], step_id)
            job.future = self._thread.submit(self._load, job)
            self._loads[load.request_id] = job
        for load in self.metadata.loads:
            if load.is_sync:  # within this plan: in the cache before the forward reads it
                self._wait_load(load)

    def _wait_load(self, load: BlockTransfer) -> None:
        job = self._loads[load.request_id]
        _, running = wait([job.future], timeout=self.ctx.load_timeout_s)
        if running:  # past its deadline: it never touches the cache again, its blocks are recomputed
            self.log.warning("kv_load_timed_out", request_id=load.request_id, timeout_s=self.ctx.load_timeout_s)
            job.cancel()
            self._failed_block_ids.update(load.block_ids)

    def save_kv(self, step_id: int) -> None:
        if not self.metadata.saves:
            return
        job = _Job(list(self.metadata.saves), step_id)
        job.future = self._thread.submit(self._save, job, self._forward_done_event())
        self._save_jobs.append(job)

    def handle_preemptions(self, preempted_req_ids: list[str]) -> None:
        preempted = set(preempted_req_ids)
        jobs = [job for job in self._save_jobs if not preempted.isdisjoint(job.request_ids)]
        if not jobs:
            return
        _, running = wait([job.future for job in jobs], timeout=self.ctx.save_timeout_s)
        late = [job for job in jobs if job.future in running]
        for job in late:  # their blocks are about to be reused: they must not read them any more
            self.log.warning(
                "kv_save_timed_out", step_id=job.step_id, request_ids=sorted(job.request_ids),
                timeout_s=self.ctx.save_timeout_s,
            )  # fmt: skip
        self._drop_saves(late)

    def abort_transfers(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        for request_id in request_ids:
            load = self._loads.pop(request_id, None)
            if load is not None:
                load.cancel()
        self._drop_saves([job for job in self._save_jobs if not aborted.isdisjoint(job.request_ids)])
        self._held -= aborted  # the wrapper reports them

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        finished_recving = set()
        for request_id, job in list(self._loads.items()):
            if job.future.done() or (job.is_cancelled and job.transfers[0].is_sync):
                del self._loads[request_id]
                finished_recving.add(request_id)
                if job.future.done():  # a sync load past its deadline counted its blocks failed
                    self._collect_load(job)
        if self._save_jobs:
            for job in [j for j in self._save_jobs if j.future.done()]:
                self._save_jobs.remove(job)
                self._collect_save(job)
        saving = set().union(*(job.request_ids for job in self._save_jobs))
        finished_sending = self._held - saving
        self._held -= finished_sending
        self._finished_sending_failed = finished_sending & self._failed_saves
        for request_id in self._finished_sending_failed:
            self.log.warning("kv_send_failed", request_id=request_id)
        # Finished and not held (or reported now): nobody asks about their saves any more.
        self._failed_saves -= finished_sending | (finished_req_ids - self._held)
        return frozenset(finished_sending), frozenset(finished_recving)

    def get_failed_sending(self) -> frozenset[str]:
        failed, self._finished_sending_failed = self._finished_sending_failed, set()
        return frozenset(failed)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return frozenset(failed)

    def get_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        return stats

    def close(self) -> None:
        for job in [*self._loads.values(), *self._save_jobs]:
            job.cancel()  # a stuck store must not hold the stage's exit
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        if isinstance(self.store, ShmBlockStore):
            self.store.unlink()

    # ---- helpers --------------------------------------------------------------------------
    def _forward_done_event(self) -> torch.cuda.Event | None:
        """CUDA: the point on the compute stream after the forward that wrote the blocks to save."""
        if not self._is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _drop_saves(self, jobs: list[_Job]) -> None:
        """Cancel these save jobs: what their requests stored cannot be trusted."""
        for job in jobs:
            job.cancel()
            self._save_jobs.remove(job)
            self._failed_saves |= job.request_ids

    def _collect_load(self, job: _Job) -> None:
        load = job.transfers[0]
        try:
            num_bytes, duration_s, failed = job.future.result()
        except TransferCancelled:
            return  # aborted: the wrapper reports it
        except Exception as e:  # noqa: BLE001 - nothing it loaded can be trusted: recompute it all
            self.log.error("kv_load_failed", step_id=job.step_id, request_id=load.request_id, error=repr(e))
            self._failed_block_ids.update(load.block_ids)
            return
        self._failed_block_ids.update(load.block_ids[i] for i in failed)
        num_loaded = len(load.block_ids) - len(failed)
        self._stats = self._stats + KVTransferStats(
            num_blocks_loaded=num_loaded, num_bytes_loaded=num_bytes, load_time_s=duration_s
        )  # fmt: skip

    def _collect_save(self, job: _Job) -> None:
        try:
            num_blocks, num_bytes, duration_s = job.future.result()
        except Exception as e:  # noqa: BLE001 - their slots are dropped when each request's send is reported
            if not isinstance(e, TransferCancelled):
                self.log.error("kv_save_failed", step_id=job.step_id, request_ids=sorted(job.request_ids), error=repr(e))
            self._failed_saves |= job.request_ids
            return
        self._stats = self._stats + KVTransferStats(
            num_blocks_saved=num_blocks, num_bytes_saved=num_bytes, save_time_s=duration_s
        )  # fmt: skip

    # ---- on the transfer thread -----------------------------------------------------------
    def _load(self, job: _Job) -> tuple[int, float, dict[int, str]]:
        load, t0 = job.transfers[0], time.perf_counter()
        failed = self.mover.load(load.block_ids, load.block_hashes, load.slots, job.cache_access)
        for i, reason in failed.items():
            self.log.warning(
                "kv_load_miss", step_id=job.step_id, request_id=load.request_id, slot=load.slots[i],
                block_hash=load.block_hashes[i].hex()[:16], reason=reason,
            )  # fmt: skip
        duration_s = time.perf_counter() - t0
        num_loaded = len(load.block_ids) - len(failed)
        self.log.info(
            "kv_load_finished", step_id=job.step_id, request_id=load.request_id, num_blocks=num_loaded,
            num_failed_blocks=len(failed), duration_ms=round(duration_s * 1e3, 3),
        )  # fmt: skip
        return num_loaded * self.layout.payload_nbytes, duration_s, failed

    def _save(self, job: _Job, ready: torch.cuda.Event | None) -> tuple[int, int, float]:
        t0 = time.perf_counter()
        block_ids, block_hashes, slots = job.joined()
        num_bytes = self.mover.save(block_ids, block_hashes, slots, job.cache_access, ready)
        duration_s = time.perf_counter() - t0
        if self._is_debug:  # a debug event is built even when filtered out: this runs beside the forward
            self.log.debug(
                "kv_saved", step_id=job.step_id, request_ids=sorted(job.request_ids), num_blocks=len(block_ids),
                duration_ms=round(duration_s * 1e3, 3),
            )  # fmt: skip
        return len(block_ids), num_bytes, duration_s
