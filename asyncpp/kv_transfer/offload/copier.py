"""Copy whole KV blocks between one stage's paged cache and host rows of store payloads.

A payload row is one block over the stage's layers, `[num_layers, 2,
block_size, num_kv_heads, head_dim]` as raw bytes (`payload_nbytes`). In a
row, a layer's K (or V) of the block is one contiguous *piece* of
`block_size * num_kv_heads * head_dim * itemsize` bytes, and so is the
block's slice of that layer's cache: every copy moves pieces, a whole run
of blocks in one call (one per (layer, K/V) on CUDA and in the numpy
fallback), never a Python loop over blocks. Bytes are copied as they are
(bit-exact, NaNs included).

* `HostCopier` (a CPU cache): one call of the `kv_records` C kernel per
  chunk (the GIL released), which copies piece by piece, prefetching the
  next piece of a random block while it copies one. It copies straight
  between the cache and any rows, the shm store's records included
  (`gather_into`, `scatter_from`: no staging), or through its own host
  staging rows. Into the store's records (`PayloadRecords`) it also
  checksums each record while its pieces are in L1 and notes the CRC32Cs
  there for the store's `seal`, and writes around the CPU's caches: nothing
  reads a saved record soon. Without the kernel (no C compiler, `isa=None`),
  numpy views the caches and rows as arrays of opaque piece-sized elements,
  so `dst[rows] = src[blocks]` is a memcpy per piece (through a temporary).
* `CudaCopier` (a CUDA cache): per (layer, K/V) an `index_select` /
  `index_copy_` on a side stream between the cache and a device scratch laid
  out as payload rows, and one copy between that scratch and pinned host
  staging rows; each call returns once the side stream is done, so the
  staging rows (after a save) and the cache (after a load) are final then.

A copier reuses its staging (grown up to `max_rows`, never per call): one
copier serves one transfer thread, one call at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncpp.kernels.kv_records import CachePieces, kv_record_kernel
from asyncpp.kv_transfer.offload.store import PayloadRecords, StoreLayout, checksum


def piece_nbytes(layout: StoreLayout, itemsize: int) -> int:
    return layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize


class HostCopier:
    def __init__(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: StoreLayout, max_rows: int, isa: str | None = "auto"
    ) -> None:
        """`isa`: the level of the `kv_records` kernel ("auto": the CPU's best; None: numpy)."""
        self.num_layers = len(kv_caches)
        self.payload_nbytes = layout.payload_nbytes
        nbytes = piece_nbytes(layout, kv_caches[0][0].element_size())
        self._piece = np.dtype((np.void, nbytes))
        self._layers = [(self._cache_pieces(k), self._cache_pieces(v)) for k, v in kv_caches]  # each [num_blocks]
        self._kernel = None if isa is None else kv_record_kernel(None if isa == "auto" else isa)
        self._pieces = CachePieces.of([cache.detach() for kv in kv_caches for cache in kv], nbytes)  # record order
        self._max_rows = max_rows
        self._staging = np.empty((0, self.payload_nbytes), dtype=np.uint8)

    def _cache_pieces(self, cache: torch.Tensor) -> np.ndarray:
        num_blocks = cache.numel() * cache.element_size() // self._piece.itemsize
        return cache.detach().view(torch.uint8).view(num_blocks, self._piece.itemsize).numpy().view(self._piece)[:, 0]

    def _row_pieces(self, rows: np.ndarray) -> np.ndarray:
        """`[n, payload_nbytes]` uint8 rows (each row contiguous) as `[n, num_layers, 2]` pieces."""
        return rows.view(self._piece).reshape(rows.shape[0], self.num_layers, 2)

    def gather_into(self, block_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray) -> None:
        """rows[row_ids[i]] := block block_ids[i] (rows: `[*, payload_nbytes]` uint8, anywhere in host memory).
        Into a store's `PayloadRecords`, the kernel also notes each record's CRC32C there."""
        if self._kernel is None:
            pieces = self._row_pieces(rows)
            for layer, kv in enumerate(self._layers):
                for j, cache in enumerate(kv):
                    dst = pieces[:, layer, j]
                    dst[row_ids] = cache[block_ids]
            return
        # A portable (software) CRC is slower than the crc32c package's hardware one: then `seal` checksums,
        # reading back records this copy left in the CPU's caches.
        records = isinstance(rows, PayloadRecords) and rows.noted_crcs is not None and self._kernel.hw_crc
        noted_crcs = rows.noted_crcs if records else None
        self._kernel.gather(self._pieces, block_ids, rows, row_ids, noted_crcs, streaming=records)

    def scatter_from(
        self, block_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray, expected_crcs: np.ndarray | None = None
    ) -> np.ndarray | None:
        """block block_ids[i] := rows[row_ids[i]]. With `expected_crcs` (`[n]`, the CRC32C row_ids[i] must
        have), returns `[n]` bool: that row was intact and copied; a row that is not is never copied."""
        if self._kernel is not None:
            # Around the CPU's caches: a chunk outgrows L2 anyway, and skipping the read of each line
            # before it is overwritten made random loads ~7% faster here.
            return self._kernel.scatter(self._pieces, block_ids, rows, row_ids, expected_crcs, streaming=True)
        block_ids, row_ids, intact = np.asarray(block_ids), np.asarray(row_ids), None
        if expected_crcs is not None:
            intact = np.array([checksum(rows[r]) == crc for r, crc in zip(row_ids, expected_crcs)], dtype=bool)
            block_ids, row_ids = block_ids[intact], row_ids[intact]
        pieces = self._row_pieces(rows)
        for layer, kv in enumerate(self._layers):
            for j, cache in enumerate(kv):
                cache[block_ids] = pieces[:, layer, j][row_ids]
        return intact

    def staging(self, num_rows: int) -> np.ndarray:
        """The first `num_rows` staging rows, `[num_rows, payload_nbytes]` uint8 (valid until the next call)."""
        if num_rows > len(self._staging):
            self._staging = np.empty((_grown(len(self._staging), num_rows, self._max_rows), self.payload_nbytes), np.uint8)
        return self._staging[:num_rows]

    def to_staging(self, block_ids: np.ndarray, ready: torch.cuda.Event | None = None) -> np.ndarray:
        """Staging row i := block block_ids[i]; returns those rows. (`ready`: CUDA only, ignored.)"""
        rows = self.staging(len(block_ids))
        self.gather_into(block_ids, rows, np.arange(len(block_ids)))
        return rows

    def from_staging(self, block_ids: np.ndarray, ready: torch.cuda.Event | None = None) -> None:
        """Block block_ids[i] := staging row i."""
        self.scatter_from(block_ids, self._staging[: len(block_ids)], np.arange(len(block_ids)))


class CudaCopier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: StoreLayout, max_rows: int) -> None:
        k0 = kv_caches[0][0]
        self.device = k0.device
        self.num_layers = len(kv_caches)
        self.payload_nbytes = layout.payload_nbytes
        nbytes = piece_nbytes(layout, k0.element_size())
        # Moved as the widest integers that tile a piece: fewer, wider elements per kernel thread.
        self._unit = next(
            t for t in (torch.int64, torch.int32, torch.int16, torch.uint8)
            if nbytes % t.itemsize == 0 and all(c.data_ptr() % t.itemsize == 0 for kv in kv_caches for c in kv)
        )
        self._piece_units = nbytes // self._unit.itemsize
        self._layers = [(self._cache_pieces(k), self._cache_pieces(v)) for k, v in kv_caches]  # each [num_blocks, units]
        self._max_rows = max_rows
        self._stream = torch.cuda.Stream(self.device)
        self._scratch = torch.empty((0, self.num_layers, 2, self._piece_units), dtype=self._unit, device=self.device)
        self._pinned = torch.empty((0, self.payload_nbytes), dtype=torch.uint8)

    def _cache_pieces(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.detach().view(-1).view(self._unit).view(-1, self._piece_units)

    def staging(self, num_rows: int) -> np.ndarray:
        """The first `num_rows` pinned staging rows as numpy (valid until the next call)."""
        if num_rows > len(self._pinned):
            # Both buffers are only touched by this copier's calls, each of which ends synchronised,
            # so the old ones are idle when they are replaced.
            num = _grown(len(self._pinned), num_rows, self._max_rows)
            self._pinned = torch.empty((num, self.payload_nbytes), dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(self._stream):
                self._scratch = torch.empty((num, self.num_layers, 2, self._piece_units), dtype=self._unit, device=self.device)
        return self._pinned[:num_rows].numpy()

    def _index(self, block_ids: np.ndarray) -> torch.Tensor:
        # From pageable memory: the copy has read `block_ids` when this returns.
        return torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64)).to(self.device, non_blocking=True)

    def to_staging(self, block_ids: np.ndarray, ready: torch.cuda.Event | None = None) -> np.ndarray:
        """Staging row i := block block_ids[i], once `ready` (recorded after the writes of those
        blocks were enqueued) has passed; returns those rows, complete."""
        num = len(block_ids)
        rows = self.staging(num)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            index = self._index(block_ids)
            scratch = self._scratch[:num]
            for layer, (k, v) in enumerate(self._layers):
                torch.index_select(k, 0, index, out=scratch[:, layer, 0])
                torch.index_select(v, 0, index, out=scratch[:, layer, 1])
            self._pinned[:num].copy_(scratch.view(torch.uint8).view(num, -1), non_blocking=True)
        self._stream.synchronize()
        return rows

    def from_staging(self, block_ids: np.ndarray, ready: torch.cuda.Event | None = None) -> None:
        """Block block_ids[i] := staging row i (after `ready`, if given); the blocks are written on return."""
        num = len(block_ids)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            scratch = self._scratch[:num]
            scratch.view(torch.uint8).view(num, -1).copy_(self._pinned[:num], non_blocking=True)
            index = self._index(block_ids)
            for layer, (k, v) in enumerate(self._layers):
                k.index_copy_(0, index, scratch[:, layer, 0])
                v.index_copy_(0, index, scratch[:, layer, 1])
        self._stream.synchronize()


def _grown(current: int, needed: int, limit: int) -> int:
    """A staging size of at least `needed` rows: doubled, so a run of growing jobs re-allocates
    O(log) times, but never past `limit` (the mover's chunk) unless a call needs more."""
    return max(needed, min(2 * current, limit))
