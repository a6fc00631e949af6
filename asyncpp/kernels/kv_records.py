"""Whole KV blocks between a paged cache and store records, checksummed on the way (`kv_records.c`).

A row is a record's payload: one block over a stage's layers, its pieces in
record order (layer 0 K, layer 0 V, layer 1 K, ...); `CachePieces` says
where each piece of a block lives in the cache. One call moves a whole chunk:

* `gather`: rows := blocks, noting each row's CRC32C (in `noted_crcs`, at
  the row's index) computed while its pieces are in L1;
* `scatter`: blocks := rows; given the CRC32Cs the rows must have, each row
  is checked first, and one that fails is never copied (reported, its
  blocks untouched);
* `ShmRecords`: the shm store's headers (`begin_write`, `seal` with the
  noted CRC32Cs, `verify`), a call for all the slots of a chunk.

Every CRC32C is the value `crc32c.crc32c` gives for the same bytes. Indices
are checked by the kernel before it writes anything (IndexError here). The
calls release the GIL (ctypes does). `kv_record_kernel(isa)` returns None
without a C compiler; a build without SSE4.2 (the `generic` level) checksums
with a portable table, ~10x slower than hardware CRC32C: its `hw_crc` is False.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from asyncpp.kernels.build import load_kernel_library
from asyncpp.kernels.isa import native_level

_I64, _U32, _PTR, _INT = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int
MAX_HEADER_NBYTES = 256  # as kv_records.c


class RecordFormat(ctypes.Structure):
    """The shm store's records, for the kernel (mirrors the C struct)."""

    _fields_ = [
        ("records", _PTR), ("num_slots", _I64), ("record_nbytes", _I64), ("header_nbytes", _I64),
        ("header_template", _PTR), ("hash_at", _I64), ("crc_at", _I64), ("noted_crcs", _PTR),
    ]  # fmt: skip


_FORMAT = ctypes.POINTER(RecordFormat)
_SIGNATURES = {
    "kv_hw_crc": ([], _INT),
    "kv_crc32c": ([_U32, _PTR, _I64], _U32),
    "kv_gather": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _INT], _INT),
    "kv_scatter": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT], _INT),
    "kv_begin_write": ([_FORMAT, _PTR, _I64], _INT),
    "kv_seal": ([_FORMAT, _PTR, _I64, ctypes.c_char_p], _INT),
    "kv_verify": ([_FORMAT, _PTR, _I64, ctypes.c_char_p, _INT, _PTR, _PTR], _INT),
}


@dataclass(frozen=True)
class CachePieces:
    """Piece p of block b: the `piece_nbytes` bytes at `addresses[p] + b * piece_nbytes`, in `tensors[p]`."""

    tensors: tuple[torch.Tensor, ...]  # kept alive here while the kernel uses their addresses
    piece_nbytes: int
    num_blocks: int
    addresses: np.ndarray  # [len(tensors)] int64

    @classmethod
    def of(cls, tensors: list[torch.Tensor], piece_nbytes: int) -> CachePieces:
        """`tensors`: contiguous CPU tensors of the same size, a whole number of pieces each."""
        nbytes = tensors[0].numel() * tensors[0].element_size()
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() != nbytes or nbytes % piece_nbytes:
                raise ValueError(f"cache pieces need contiguous CPU tensors of {nbytes} bytes, {piece_nbytes}-byte pieces")
        addresses = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
        return cls(tuple(tensors), piece_nbytes, nbytes // piece_nbytes, addresses)

    @property
    def row_nbytes(self) -> int:
        return len(self.tensors) * self.piece_nbytes


class KvRecordKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib
        self.hw_crc = bool(lib.kv_hw_crc())

    def crc32c(self, data: np.ndarray, value: int = 0) -> int:
        """`crc32c.crc32c(data, value)` of a contiguous array's bytes."""
        if not data.flags.c_contiguous:
            raise ValueError("crc32c needs a contiguous array")
        return self._lib.kv_crc32c(value, data.ctypes.data, data.nbytes)

    def gather(
        self, pieces: CachePieces, block_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray,
        noted_crcs: np.ndarray | None = None, streaming: bool = False,
    ) -> None:  # fmt: skip
        """rows[row_ids[i]] := block block_ids[i] (rows: `[n, row_nbytes]` uint8, contiguous rows); with
        `noted_crcs` (`[n]` int64), noted_crcs[row_ids[i]] := that row's CRC32C. `streaming`: write the
        rows around the CPU's caches, for rows nobody reads soon."""
        block_ids, row_ids = _ids(block_ids), _ids(row_ids)
        _check(pieces, rows, block_ids, row_ids, writable=True)
        if noted_crcs is not None and (noted_crcs.dtype != np.int64 or noted_crcs.shape != (rows.shape[0],)):
            raise ValueError(f"noted_crcs must be [{rows.shape[0]}] int64")
        status = self._lib.kv_gather(
            pieces.addresses.ctypes.data, len(pieces.tensors), pieces.piece_nbytes, pieces.num_blocks, block_ids.ctypes.data,
            rows.ctypes.data, rows.strides[0], rows.shape[0], row_ids.ctypes.data, len(row_ids),
            None if noted_crcs is None else noted_crcs.ctypes.data, int(streaming),
        )  # fmt: skip
        _raise_on(status, pieces, rows)

    def scatter(
        self, pieces: CachePieces, block_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray,
        expected_crcs: np.ndarray | None = None, streaming: bool = False,
    ) -> np.ndarray | None:  # fmt: skip
        """block block_ids[i] := rows[row_ids[i]]. With `expected_crcs` (`[n]`), returns `[n]` bool: row i's
        CRC32C was expected_crcs[i] and it was copied (a row that fails is not copied at all)."""
        block_ids, row_ids = _ids(block_ids), _ids(row_ids)
        _check(pieces, rows, block_ids, row_ids, writable=False)
        intact = None
        if expected_crcs is not None:
            expected_crcs = np.ascontiguousarray(expected_crcs, dtype=np.uint32)
            if expected_crcs.shape != (len(row_ids),):
                raise ValueError(f"{expected_crcs.shape} expected checksums for {len(row_ids)} rows")
            intact = np.zeros(len(row_ids), dtype=np.bool_)
        status = self._lib.kv_scatter(
            pieces.addresses.ctypes.data, len(pieces.tensors), pieces.piece_nbytes, pieces.num_blocks, block_ids.ctypes.data,
            rows.ctypes.data, rows.strides[0], rows.shape[0], row_ids.ctypes.data, len(row_ids),
            None if intact is None else expected_crcs.ctypes.data, None if intact is None else intact.ctypes.data,
            int(streaming),
        )  # fmt: skip
        _raise_on(status, pieces, rows)
        return intact

    def shm_records(
        self, records: np.ndarray, header_template: bytes, hash_at: int, crc_at: int, noted_crcs: np.ndarray
    ) -> ShmRecords:
        return ShmRecords(self._lib, records, header_template, hash_at, crc_at, noted_crcs)


class ShmRecords:
    """The kernel bound to a store's records `[num_slots, record_nbytes]` uint8 (contiguous): a header of
    `len(header_template)` bytes, which is the template with the block's 32-byte hash at `hash_at` and the
    payload's CRC32C (little-endian) at `crc_at`, then the payload. `noted_crcs` (`[num_slots]` int64, -1:
    none) holds CRC32Cs a gather noted. Keeps its arrays alive; not thread-safe (its outputs are reused)."""

    def __init__(
        self, lib: ctypes.CDLL, records: np.ndarray, header_template: bytes, hash_at: int, crc_at: int, noted_crcs: np.ndarray
    ) -> None:
        header_nbytes = len(header_template)
        if records.dtype != np.uint8 or records.ndim != 2 or not records.flags.c_contiguous:
            raise ValueError("records must be a contiguous [num_slots, record_nbytes] uint8 array")
        if not (0 <= hash_at and hash_at + 32 <= crc_at and crc_at + 4 <= header_nbytes <= min(MAX_HEADER_NBYTES, records.shape[1])):
            raise ValueError(f"a {header_nbytes}-byte header with the hash at {hash_at} and the CRC at {crc_at} does not fit")
        if noted_crcs.dtype != np.int64 or noted_crcs.shape != (records.shape[0],) or not noted_crcs.flags.c_contiguous:
            raise ValueError(f"noted_crcs must be [{records.shape[0]}] int64")
        self._lib, self._records, self._noted_crcs = lib, records, noted_crcs  # kept alive for the format's pointers
        self._template = np.frombuffer(header_template, dtype=np.uint8).copy()
        self._format = RecordFormat(
            records.ctypes.data, records.shape[0], records.shape[1], header_nbytes,
            self._template.ctypes.data, hash_at, crc_at, noted_crcs.ctypes.data,
        )  # fmt: skip
        self._status = np.empty(0, dtype=np.uint8)
        self._crcs = np.empty(0, dtype=np.uint32)

    def begin_write(self, slot_ids: np.ndarray) -> None:
        """Zero these slots' headers and forget CRC32Cs noted for them."""
        slot_ids = _ids(slot_ids)
        self._raise_on(self._lib.kv_begin_write(self._format, slot_ids.ctypes.data, len(slot_ids)))

    def seal(self, slot_ids: np.ndarray, block_hashes: bytes) -> None:
        """Write each slot's header (block_hashes: 32 bytes a slot), with its noted CRC32C (then forgotten),
        else its payload's as it is now."""
        slot_ids = _ids(slot_ids)
        self._check_hashes(slot_ids, block_hashes)
        self._raise_on(self._lib.kv_seal(self._format, slot_ids.ctypes.data, len(slot_ids), block_hashes))

    def verify(self, slot_ids: np.ndarray, block_hashes: bytes, check_payload: bool) -> tuple[np.ndarray, np.ndarray]:
        """(`[n]` uint8 status: 0 fits (and with `check_payload`, the payload's CRC32C is the header's), 1 the
        header does not fit the template and the hash, 2 the payload's CRC32C differs; `[n]` uint32: the
        CRC32C each header holds). Both arrays are reused by the next call."""
        slot_ids = _ids(slot_ids)
        self._check_hashes(slot_ids, block_hashes)
        num = len(slot_ids)
        if num > len(self._status):
            self._status, self._crcs = np.empty(2 * num, dtype=np.uint8), np.empty(2 * num, dtype=np.uint32)
        self._raise_on(
            self._lib.kv_verify(
                self._format, slot_ids.ctypes.data, num, block_hashes, int(check_payload), self._status.ctypes.data,
                self._crcs.ctypes.data,
            )
        )
        return self._status[:num], self._crcs[:num]

    def _check_hashes(self, slot_ids: np.ndarray, block_hashes: bytes) -> None:
        if len(block_hashes) != 32 * len(slot_ids):
            raise ValueError(f"{len(block_hashes)} bytes of block hashes for {len(slot_ids)} slots (32 bytes each)")

    def _raise_on(self, status: int) -> None:
        if status:
            raise IndexError(f"a slot outside 0..{self._format.num_slots - 1}")


def _ids(ids) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError("ids must be 1-d")
    return ids


def _check(pieces: CachePieces, rows: np.ndarray, block_ids: np.ndarray, row_ids: np.ndarray, writable: bool) -> None:
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.strides[1] != 1 or rows.shape[1] != pieces.row_nbytes:
        raise ValueError(f"rows must be [n, {pieces.row_nbytes}] uint8 with contiguous rows, got {rows.shape} {rows.dtype}")
    if writable and not rows.flags.writeable:
        raise ValueError("rows are read-only")
    if len(block_ids) != len(row_ids):
        raise ValueError(f"{len(block_ids)} block ids, {len(row_ids)} row ids")


def _raise_on(status: int, pieces: CachePieces, rows: np.ndarray) -> None:
    if status:
        raise IndexError(f"a block outside 0..{pieces.num_blocks - 1} or a row outside 0..{rows.shape[0] - 1}")


@functools.cache
def kv_record_kernel(isa: str | None = None) -> KvRecordKernel | None:
    """The kernel built for level `isa` (default: the CPU's best), or None without a C compiler."""
    lib = load_kernel_library("kv_records", isa or native_level())
    return None if lib is None else KvRecordKernel(lib)
