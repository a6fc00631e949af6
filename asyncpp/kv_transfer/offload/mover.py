"""Save and load whole KV blocks between one stage's paged cache and its `BlockStore`, at copy speed.

`BlockMover.save` stores blocks (block_ids[i] -> slots[i] under
block_hashes[i]); `load` fills blocks from slots and returns, per block it
did not load, why (missing, hash / fingerprint / size mismatch, checksum
mismatch: a bad record is a miss, never wrong KV). A job goes in chunks of
at most `max_chunk_nbytes` of payload; per chunk:

* CPU cache, shm store: straight between the cache and the records in the
  segment (headers zeroed, pieces copied and checksummed in one pass by the
  `kv_records` kernel, then sealed; loads check headers, then each record's
  checksum as it is copied out, and never copy one that fails).
* otherwise: through the copier's staging rows (pinned for a CUDA cache),
  and the store reads or writes those rows.

Every read or write of the cache tensors happens inside `with
cache_access():`, entered once per chunk that touches the cache; the
worker's guard there holds the job's lock and raises `TransferCancelled`
once the job was cancelled, so a timed-out job never touches blocks the
engine has since reused. The exception propagates out of `save`/`load`; the
chunks before it are complete, and a chunk it stops leaves its slots reading
as missing (shm: headers zeroed before the copy) or untouched (directory:
files are written after the guard). Store I/O that can block (files) runs
outside the guard, memory copies inside it. On CUDA, `ready` (an event
recorded on the compute stream after the forward that wrote the blocks was
enqueued) is waited for on the side stream before the cache is read, and
both calls return only once their device copies are complete.

Not thread-safe: one mover per transfer thread, one job at a time (its
staging is reused, and a load trusts that no save writes its slots meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from asyncpp.dtypes import torch_dtype
from asyncpp.kv_transfer.offload.copier import CudaCopier, HostCopier
from asyncpp.kv_transfer.offload.store import BlockStore, ShmBlockStore, StoreLayout, whole_rows

CacheAccess = Callable[[], AbstractContextManager[object]]
_DEVICES = ("cpu", "cuda")


class TransferCancelled(Exception):
    """Raised by the worker's cache guard when the job was cancelled (it timed out)."""


class BlockMover:
    """Moves whole KV blocks between one stage's paged cache and its BlockStore."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        store: BlockStore,
        max_chunk_nbytes: int = 16 << 20,
    ) -> None:
        self.store = store
        self.layout = store.layout
        self.device = check_kv_caches(kv_caches, block_size, self.layout)
        self.num_blocks = kv_caches[0][0].shape[0] // block_size
        self.chunk_blocks = max(1, max_chunk_nbytes // self.layout.payload_nbytes)
        copier = HostCopier if self.device.type == "cpu" else CudaCopier
        self._copier = copier(kv_caches, self.layout, self.chunk_blocks)
        self._in_place = self.device.type == "cpu" and isinstance(store, ShmBlockStore)

    def save(
        self,
        block_ids: list[int],
        block_hashes: list[bytes],
        slots: list[int],
        cache_access: CacheAccess,
        ready: torch.cuda.Event | None = None,
    ) -> int:
        """Store these blocks (block_ids[i] -> slots[i] under block_hashes[i]); returns bytes saved."""
        self._check_job(block_ids, block_hashes, slots)
        for start in range(0, len(block_ids), self.chunk_blocks):
            end = start + self.chunk_blocks
            self._save_chunk(block_ids[start:end], block_hashes[start:end], slots[start:end], cache_access, ready)
        return len(block_ids) * self.layout.payload_nbytes

    def load(
        self,
        block_ids: list[int],
        block_hashes: list[bytes],
        slots: list[int],
        cache_access: CacheAccess,
        ready: torch.cuda.Event | None = None,
    ) -> dict[int, str]:
        """Load these slots into these blocks; returns {index into block_ids: reason} for blocks NOT
        loaded. `ready` (CUDA, optional): an event the writes into the cache wait for."""
        self._check_job(block_ids, block_hashes, slots)
        failed: dict[int, str] = {}
        for start in range(0, len(block_ids), self.chunk_blocks):
            end = start + self.chunk_blocks
            chunk = block_ids[start:end], block_hashes[start:end], slots[start:end]
            misses = self._load_chunk(*chunk, cache_access, ready)
            failed.update({start + i: reason for i, reason in misses.items()})
        return failed

    # ---- one chunk ------------------------------------------------------------------------
    def _save_chunk(
        self, block_ids: list[int], block_hashes: list[bytes], slots: list[int], cache_access: CacheAccess, ready
    ) -> None:
        blocks = np.asarray(block_ids, dtype=np.intp)
        if self._in_place:
            self.store.begin_write(slots)
            with cache_access():
                self._copier.gather_into(blocks, self.store.payload_records(), np.asarray(slots, dtype=np.intp))
            self.store.seal(slots, block_hashes)
            return
        with cache_access():
            rows = self._copier.to_staging(blocks, ready)
        self.store.write_many(slots, block_hashes, rows)

    def _load_chunk(
        self, block_ids: list[int], block_hashes: list[bytes], slots: list[int], cache_access: CacheAccess, ready
    ) -> dict[int, str]:
        if self._in_place:  # headers now; each payload's checksum as it is copied (one pass over it)
            reasons, crcs = self.store.check_headers(slots, block_hashes)
        else:
            rows = self._copier.staging(len(slots))
            reasons = self.store.read_many_into(slots, block_hashes, rows)
        good = [i for i, reason in enumerate(reasons) if reason is None]
        misses = {i: reason for i, reason in enumerate(reasons) if reason is not None}
        if not good:
            return misses
        blocks = np.asarray([block_ids[i] for i in good], dtype=np.intp)
        if self._in_place:
            slot_index = np.asarray([slots[i] for i in good], dtype=np.intp)
            with cache_access():
                intact = self._copier.scatter_from(blocks, self.store.payload_records(), slot_index, crcs[good])
            # A record whose payload fails its checksum is never copied: its block keeps its bytes and
            # is reported, so the engine recomputes it.
            misses.update({good[k]: "checksum mismatch" for k in np.flatnonzero(~intact)})
            return misses
        if misses:  # the good rows first, in order: the copier loads staging row i into blocks[i]
            whole_rows(rows)[: len(good)] = whole_rows(rows)[good]
        with cache_access():
            self._copier.from_staging(blocks, ready)
        return misses

    def _check_job(self, block_ids: list[int], block_hashes: list[bytes], slots: list[int]) -> None:
        if not len(block_ids) == len(block_hashes) == len(slots):
            raise ValueError(f"{len(block_ids)} block ids, {len(block_hashes)} hashes, {len(slots)} slots")
        # Checked here, not by the copy: an index out of range on a GPU is a device-side assert.
        if block_ids and not (0 <= min(block_ids) and max(block_ids) < self.num_blocks):
            raise ValueError(f"block ids {min(block_ids)}..{max(block_ids)} outside the cache's 0..{self.num_blocks - 1}")
        if slots and not (0 <= min(slots) and max(slots) < self.layout.num_slots):
            raise ValueError(f"slots {min(slots)}..{max(slots)} outside the store's 0..{self.layout.num_slots - 1}")


def check_kv_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, layout: StoreLayout) -> torch.device:
    """The caches' device, if a mover can move their blocks into a store of `layout`; else ValueError saying why."""
    if not kv_caches:
        raise ValueError("no KV caches")
    device = kv_caches[0][0].device
    if device.type not in _DEVICES:
        raise ValueError(f"KV cache on device {device}: the offload mover moves blocks of cpu and cuda caches only")
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"{len(kv_caches)} layers of KV cache, the store's layout has {layout.num_layers}")
    if block_size != layout.block_size:
        raise ValueError(f"block size {block_size}, the store's layout has {layout.block_size}")
    dtype = torch_dtype(layout.dtype)
    shape = kv_caches[0][0].shape
    for layer, pair in enumerate(kv_caches):
        for name, cache in zip("KV", pair):
            what = f"layer {layer} {name} cache"
            if cache.device != device:
                raise ValueError(f"{what} on device {cache.device}, layer 0's on {device}")
            if cache.dtype != dtype:
                raise ValueError(f"{what} has dtype {cache.dtype}, the store's layout {layout.dtype}")
            if cache.shape != shape or cache.dim() != 3 or shape[0] % block_size:
                raise ValueError(
                    f"{what} has shape {tuple(cache.shape)}: expected [num_blocks * {block_size}, heads, dim] "
                    f"like layer 0's {tuple(shape)}"
                )
            if (shape[1], shape[2]) != (layout.num_kv_heads, layout.head_dim):
                raise ValueError(
                    f"{what} has {shape[1]} heads x {shape[2]}, the store's layout {layout.num_kv_heads} x {layout.head_dim}"
                )
            if not cache.is_contiguous():
                raise ValueError(f"{what} is not contiguous")
    return device
