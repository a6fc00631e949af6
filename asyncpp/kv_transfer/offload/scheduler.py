"""Scheduler side of the offload connector: which block hashes the stores hold, and where.

The engine owns the index (`OffloadIndex`: hash -> slot, LRU, byte limit as
a slot count); the stages own the bytes. So eviction is decided once, the
same slot names the same block on every stage, and a block is loadable only
once every stage has stored its layers.

* Saves: every full block a plan computes (its hash known) that the store
  does not hold gets a slot and a save; the slot stays PENDING until the
  request is finished sending on every stage, then READY, or free again if
  any stage's save failed, was skipped (its step failed) or timed out.
* Loads: a waiting request's leading READY blocks after the engine's own
  cache hits load asynchronously; their slots are pinned (never evicted or
  overwritten) until every stage has reported the load. A block that failed
  to load on any stage is dropped from the index.
* `dir` stores survive a restart: at start-up the index is rebuilt from the
  slots whose headers agree on every stage, oldest file first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncpp.config import ConfigError
from asyncpp.kv.block_hash import BlockHash, hash_block
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorScheduler, PlanInfo
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVConnectorOutput
from asyncpp.kv_transfer.offload.index import OffloadIndex
from asyncpp.kv_transfer.offload.layout import shm_name, stage_dir, stage_layouts
from asyncpp.kv_transfer.offload.store import DirBlockStore, ShmBlockStore
from asyncpp.logging import get_logger

if TYPE_CHECKING:
    from asyncpp.core.request import Request


class OffloadScheduler(KVConnectorScheduler):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        load = ctx.extra.get("load", "async")
        if load not in ("async", "sync"):
            raise ConfigError(f"kv_transfer.options.load must be 'async' or 'sync', got {load!r}")
        # sync: a hit is loaded within the plan that computes the rest of the prompt (a failed block
        # makes the requests that read it start again); async: the request waits for its load.
        self.is_load_async = load == "async"
        self.layouts = stage_layouts(ctx)
        self.index = OffloadIndex(self.layouts[0].num_slots)
        self.log = get_logger(role="engine", connector="offload")
        self._prompt_hashes: dict[str, list[BlockHash]] = {}  # waiting request -> its full prompt blocks' hashes
        self._loads: dict[str, BlockTransfer] = {}  # in flight (slots pinned)
        self._loading: dict[BlockHash, int] = {}  # hashes of the loads in flight -> how many
        self._unsent_loads: list[BlockTransfer] = []
        self._saving: dict[str, list[BlockHash]] = {}  # request -> hashes it saves (PENDING until it is finished)
        self._num_saved_blocks: dict[str, int] = {}  # request -> leading full blocks already considered
        self._invalid_block_ids: set[int] = set()  # failed on some stage; until their load is complete
        if ctx.store == "dir":
            self._restore()

    # ---- loads ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        hashes = self._hashes_of(request)
        first = num_computed_tokens // self.ctx.block_size
        if first < len(hashes) and hashes[first] in self._loading:
            # Another request is loading this prefix: once it is in the engine's cache this one
            # hits it there, instead of loading (and holding) the same blocks a second time.
            return None, False
        num_blocks = self.index.lookup(hashes[first:])
        return num_blocks * self.ctx.block_size, num_blocks > 0 and self.is_load_async

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        bs = self.ctx.block_size
        first = request.num_computed_tokens // bs
        last = first + num_external_tokens // bs
        hashes = self._hashes_of(request)[first:last]
        load = BlockTransfer(
            request.request_id, block_ids[first:last], hashes, self.index.pin(hashes), is_sync=not self.is_load_async
        )
        self._loads[request.request_id] = load
        for block_hash in hashes:
            self._loading[block_hash] = self._loading.get(block_hash, 0) + 1
        self._unsent_loads.append(load)

    def has_unsent_metadata(self) -> bool:
        return bool(self._unsent_loads)

    # ---- saves ----------------------------------------------------------------------------
    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        loads, self._unsent_loads = self._unsent_loads, []
        saves = []
        bs = self.ctx.block_size
        for request, start, num_tokens in plan.scheduled:
            request_id = request.request_id
            block_hashes = plan.block_hashes[request_id]
            num_full = min((start + num_tokens) // bs, len(block_hashes))
            done = self._num_saved_blocks.get(request_id, 0)
            if num_full <= done:
                continue
            self._num_saved_blocks[request_id] = num_full
            placed = self.index.prepare_store(block_hashes[done:num_full])
            if not placed:
                continue
            position = {h: done + i for i, h in enumerate(block_hashes[done:num_full])}
            block_ids = plan.block_ids[request_id]
            saves.append(
                BlockTransfer(
                    request_id,
                    [block_ids[position[h]] for h, _ in placed],
                    [h for h, _ in placed],
                    [slot for _, slot in placed],
                )
            )
            self._saving.setdefault(request_id, []).extend(h for h, _ in placed)
        return KVConnectorMetadata(loads, saves)

    # ---- reports --------------------------------------------------------------------------
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        # Stages report failed blocks as their own loads end, often steps before the last stage.
        self._invalid_block_ids |= output.invalid_block_ids
        for request_id in output.finished_recving:
            load = self._loads.pop(request_id, None)
            if load is None:
                continue
            self.index.unpin(load.block_hashes)
            for block_hash in load.block_hashes:
                if self._loading.get(block_hash, 0) <= 1:
                    self._loading.pop(block_hash, None)
                else:
                    self._loading[block_hash] -= 1
            bad = [h for h, b in zip(load.block_hashes, load.block_ids) if b in self._invalid_block_ids]
            self._invalid_block_ids.difference_update(load.block_ids)
            if bad:
                self.log.warning("kv_store_blocks_dropped", request_id=request_id, num_blocks=len(bad))
                self.index.discard(bad)
        for request_id in output.finished_sending:
            # A save that failed (or was skipped, or timed out) on any stage leaves its slots
            # unverifiable there: drop them rather than offer them to loads.
            self.index.complete_store(self._saving.pop(request_id, []), success=request_id not in output.failed_sending)

    # ---- a stage restart -------------------------------------------------------------------
    can_forget_transfers = True

    def forget_transfers(self) -> None:
        """The stages died with their transfers: loads unpin their slots; the slots of saves not
        reported stored on every stage are freed (a record half written, or written by some stages
        only, is never offered). READY blocks stay: the records are sealed in shared memory or files
        that outlive a stage, and the new stages load them (each checks header and checksum)."""
        for load in self._loads.values():
            self.index.unpin(load.block_hashes)
        num_unsaved = 0
        for hashes in self._saving.values():
            num_unsaved += len(hashes)
            self.index.complete_store(hashes, success=False)
        self.log.info(
            "kv_store_transfers_forgotten", num_loads=len(self._loads), num_unsaved_blocks=num_unsaved,
            num_ready_blocks=self.index.num_ready,
        )  # fmt: skip
        self._loads.clear()
        self._loading.clear()
        self._unsent_loads.clear()
        self._saving.clear()
        self._num_saved_blocks.clear()  # every request computes its blocks again, and may save them
        self._invalid_block_ids.clear()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._prompt_hashes.pop(request_id, None)
        self._num_saved_blocks.pop(request_id, None)
        # Its saves read its blocks on every stage until each reports them done.
        return request_id in self._saving, None

    def stats(self) -> dict[str, Any]:
        return {
            "kv_store": self.ctx.store,
            "kv_store_slots": self.index.num_slots,
            "kv_store_ready_blocks": self.index.num_ready,
            "kv_store_pending_blocks": self.index.num_pending,
            "kv_store_pinned_blocks": self.index.num_pinned,
            "kv_store_bytes_per_stage": [layout.num_slots * layout.record_nbytes for layout in self.layouts],
        }

    def close(self) -> None:
        """Remove shared-memory stores a killed stage could not (each stage removes its own on exit)."""
        if self.ctx.store != "shm":
            return
        for rank, layout in enumerate(self.layouts):
            try:
                store = ShmBlockStore(shm_name(self.ctx, rank), layout, create=False)
            except FileNotFoundError:
                continue
            store.close()
            store.unlink()

    # ---- helpers --------------------------------------------------------------------------
    def _hashes_of(self, request: "Request") -> list[BlockHash]:
        """The chained hashes of the request's full blocks, all but the one holding its last token."""
        hashes = self._prompt_hashes.get(request.request_id)
        token_ids = request.all_token_ids
        bs = self.ctx.block_size
        num_blocks = max(0, (len(token_ids) - 1) // bs)
        if hashes is None or len(hashes) != num_blocks:
            hashes, parent = [], None
            for i in range(num_blocks):
                parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
                hashes.append(parent)
            self._prompt_hashes[request.request_id] = hashes
        return hashes

    def _restore(self) -> None:
        """Index the blocks every stage's directory holds, at the same slot, oldest file first."""
        common: dict[int, BlockHash] | None = None
        mtimes: dict[int, float] = {}
        for rank, layout in enumerate(self.layouts):
            directory = stage_dir(self.ctx, rank)
            try:
                store = DirBlockStore(directory, layout)
            except OSError as e:
                raise ConfigError(f"kv_transfer.store_path: cannot use {directory}: {e}") from e
            try:
                found = store.scan()
            finally:
                store.close()
            if rank == 0:
                for slot in found:
                    mtimes[slot] = (directory / f"slot-{slot:08d}.kv").stat().st_mtime
            common = found if common is None else {s: h for s, h in common.items() if found.get(s) == h}
        entries = sorted((common or {}).items(), key=lambda item: mtimes.get(item[0], 0.0))
        self.index.restore(entries)
        self.log.info("kv_store_restored", num_blocks=self.index.num_ready, store_path=self.ctx.store_path)
