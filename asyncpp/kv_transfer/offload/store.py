"""One stage's offload store: `num_slots` fixed-size records, in shared memory or in files.

A record is a 128-byte header and one block's payload (`[num_layers, 2,
block_size, num_kv_heads, head_dim]`, raw bytes). The header holds a magic,
a format version, the layout's fingerprint (model, this stage's layers,
dtype, block size: a record written for anything else is a miss), the
block's hash, the payload size and its CRC32C (hardware CRC through the
`crc32c` package, which releases the GIL: ~23 GB/s on one Zen 4 core, 4x
zlib's CRC32; the shm store checks and seals a batch of records in one call
of the `kv_records` C kernel instead, ~25 GB/s from memory). `read_into` and
`read_many_into` check all of it and return why a record is unusable
instead of raising: a missing, truncated or corrupted block is a miss,
never wrong KV.

`write`/`read_into` move one block; `write_many`/`read_many_into` move a
batch of rows (`[n, payload_nbytes]` host bytes), the shm store with one
vectorised copy for the whole batch.

* `ShmBlockStore`: one shared-memory segment; the payload is written first
  and the header last, so a half-written slot fails the check. It can also
  be written and read in place (`payload_records`: `begin_write`, copy,
  `seal`; `verify`, copy), which the `BlockMover` does for a CPU cache. A
  copier that checksums the payloads as it writes them leaves the CRC32Cs
  with the `PayloadRecords` it wrote into, and `seal` uses them instead of
  reading every payload back from memory.
* `DirBlockStore`: one file per slot, written to a temporary file and
  renamed, so a crash never leaves a half record under a slot's name; the
  files outlive the engine (`scan` finds them at the next start).
Which hash lives in which slot is decided by the engine's `OffloadIndex`.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import crc32c
import numpy as np
import torch

from asyncpp.dtypes import torch_dtype
from asyncpp.kernels.kv_records import ShmRecords, kv_record_kernel

HEADER_NBYTES = 128
_MAGIC = b"APKV"
_VERSION = 2  # 2: the checksum is CRC32C (1 was zlib's CRC32)
_HEADER = struct.Struct("<4sI32s32sQI")  # magic, version, fingerprint, block hash, payload bytes, crc32c
_HASH_AT = struct.calcsize("<4sI32s")  # where the block hash starts; all before it is the same in every record
_CRC_AT = struct.calcsize("<4sI32s32sQ")


@dataclass(frozen=True)
class StoreLayout:
    num_slots: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    fingerprint: bytes  # 32 bytes

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 bytes, got {len(self.fingerprint)}")
        torch_dtype(self.dtype)

    @property
    def payload_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_nbytes(self) -> int:
        return int(np.prod(self.payload_shape)) * torch_dtype(self.dtype).itemsize

    @property
    def record_nbytes(self) -> int:
        return HEADER_NBYTES + self.payload_nbytes


def store_fingerprint(
    model_id: str, start_layer: int, end_layer: int, dtype: str, block_size: int, num_kv_heads: int, head_dim: int
) -> bytes:
    text = f"{model_id}|{start_layer}|{end_layer}|{dtype}|{block_size}|{num_kv_heads}|{head_dim}"
    return hashlib.sha256(text.encode()).digest()


def slots_for_budget(budget_bytes: int, record_nbytes: int) -> int:
    return max(0, budget_bytes // record_nbytes)


def checksum(data) -> int:
    """CRC32C of a contiguous buffer (bytes, memoryview, numpy array)."""
    return crc32c.crc32c(data)


def whole_rows(rows: np.ndarray) -> np.ndarray:
    """`[n, nbytes]` uint8 rows as `[n]` elements of one opaque `nbytes` type: numpy then copies a
    selection of rows with one memcpy each instead of an element loop."""
    return rows.view(np.dtype((np.void, rows.shape[1])))[:, 0]


class PayloadRecords(np.ndarray):
    """The shm store's record payloads, `[num_slots, payload_nbytes]` uint8 in the segment itself
    (`ShmBlockStore.payload_records`). A copier that computes the CRC32C of a payload as it writes it
    into row i notes it at `noted_crcs[i]`, for the store's `seal` (until the slot's next
    `begin_write`). Only the array the store handed out carries the notes: a view of it (a slice, a
    reshape) has none."""

    noted_crcs: np.ndarray | None  # [num_slots] int64, the store's: a CRC32C, or -1 for none

    def __array_finalize__(self, obj) -> None:
        self.noted_crcs = None


def _joined(block_hashes: list[bytes]) -> bytes:
    joined = b"".join(block_hashes)
    if len(joined) != 32 * len(block_hashes) or any(len(h) != 32 for h in block_hashes):
        raise ValueError("block hashes must be 32 bytes")
    return joined


def _payload_bytes(payload: torch.Tensor) -> np.ndarray:
    """The payload's bytes as a uint8 array (a view, no copy)."""
    return payload.view(torch.uint8).numpy().reshape(-1)


class BlockStore(ABC):
    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout

    @property
    def nbytes(self) -> int:
        return self.layout.num_slots * self.layout.record_nbytes

    def write(self, slot: int, block_hash: bytes, payload: torch.Tensor) -> None:
        self._check_slot(slot)
        self._check_payload(payload)
        data = _payload_bytes(payload)
        header = self._header(block_hash, data)
        self._write(slot, header, data)

    def read_into(self, slot: int, block_hash: bytes, out: torch.Tensor) -> str | None:
        """Copy the slot's payload into `out`; None if it holds `block_hash` intact, else why not."""
        self._check_slot(slot)
        self._check_payload(out)
        return self._read_into(slot, block_hash, _payload_bytes(out))

    def write_many(self, slots: list[int], block_hashes: list[bytes], payloads: np.ndarray) -> None:
        """Store row i of `payloads` (`[n, payload_nbytes]` uint8, host) in slots[i] under block_hashes[i]."""
        self._check_rows(slots, block_hashes, payloads)
        for slot, block_hash, data in zip(slots, block_hashes, payloads):
            self._write(slot, self._header(block_hash, data), data)

    def read_many_into(self, slots: list[int], block_hashes: list[bytes], out: np.ndarray) -> list[str | None]:
        """Copy slots[i]'s payload into row i of `out`; per slot None if it held block_hashes[i] intact,
        else why not (that row's bytes are then undefined)."""
        self._check_rows(slots, block_hashes, out)
        return [self._read_into(slot, block_hash, row) for slot, block_hash, row in zip(slots, block_hashes, out)]

    @abstractmethod
    def scan(self) -> dict[int, bytes]:
        """slot -> block hash of every slot whose header fits this layout (no checksum: cheap)."""

    def close(self) -> None:
        pass

    @abstractmethod
    def _write(self, slot: int, header: bytes, data: np.ndarray) -> None: ...

    @abstractmethod
    def _read_into(self, slot: int, block_hash: bytes, out: np.ndarray) -> str | None: ...

    # ---- helpers --------------------------------------------------------------------------
    def _header(self, block_hash: bytes, data, crc: int | None = None) -> bytes:
        """The header of `data` (a bytes-like payload), whose CRC32C is `crc` if known."""
        if len(block_hash) != 32:
            raise ValueError(f"block hash must be 32 bytes, got {len(block_hash)}")
        crc = checksum(data) if crc is None else crc
        packed = _HEADER.pack(_MAGIC, _VERSION, self.layout.fingerprint, block_hash, memoryview(data).nbytes, crc)
        return packed.ljust(HEADER_NBYTES, b"\0")

    def _check_header(self, header, block_hash: bytes | None) -> tuple[str | None, int]:
        """(why the header (a bytes-like of HEADER_NBYTES) is unusable or None, the payload's crc32c)."""
        magic, version, fingerprint, stored_hash, nbytes, crc = _HEADER.unpack_from(header)
        if magic == b"\0\0\0\0":
            return "missing", 0
        if magic != _MAGIC:
            return "bad magic", 0
        if version != _VERSION:
            return "version", 0
        if fingerprint != self.layout.fingerprint:
            return "fingerprint mismatch", 0
        if nbytes != self.layout.payload_nbytes:
            return "size mismatch", 0
        if block_hash is not None and stored_hash != block_hash:
            return "hash mismatch", 0
        return None, crc

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.layout.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.layout.num_slots - 1}")

    def _check_rows(self, slots: list[int], block_hashes: list[bytes], rows: np.ndarray) -> None:
        nbytes = self.layout.payload_nbytes
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != nbytes or rows.strides[1] != 1:
            raise ValueError(f"payload rows must be [n, {nbytes}] uint8 with contiguous rows, got {rows.shape} {rows.dtype}")
        if not len(slots) == len(block_hashes) == rows.shape[0]:
            raise ValueError(f"{len(slots)} slots, {len(block_hashes)} hashes, {rows.shape[0]} payload rows")
        for slot in slots:
            self._check_slot(slot)

    def _check_payload(self, payload: torch.Tensor) -> None:
        layout = self.layout
        if tuple(payload.shape) != layout.payload_shape or payload.dtype != torch_dtype(layout.dtype):
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype}, expected {layout.payload_shape} {layout.dtype}")
        if not payload.is_contiguous() or payload.device.type != "cpu":
            raise ValueError("payload must be a contiguous CPU tensor")


class ShmBlockStore(BlockStore):
    def __init__(self, name: str, layout: StoreLayout, create: bool, isa: str | None = "auto") -> None:
        """`isa`: the level whose `kv_records` kernel checksums batches ("auto": the CPU's best; None, or a
        build without hardware CRC32C: the `crc32c` package, a call per record)."""
        super().__init__(layout)
        self.name = name
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=self.nbytes if create else 0)
        if not create:
            # Attaching registers the segment with this process's resource tracker, which would
            # remove it when this process exits: only its creator may.
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        if self._shm.size < self.nbytes:
            self._shm.close()
            raise ValueError(f"shared memory {name} holds {self._shm.size} bytes, the layout needs {self.nbytes}")
        self._records = np.ndarray((layout.num_slots, layout.record_nbytes), dtype=np.uint8, buffer=self._shm.buf)
        self._is_owner = create
        self._noted_crcs = np.full(layout.num_slots, -1, dtype=np.int64)
        self._payloads = self._records[:, HEADER_NBYTES:].view(PayloadRecords)  # made once: a view is not free
        self._payloads.noted_crcs = self._noted_crcs
        # Every header is this but for the block hash and the CRC32C.
        template = _HEADER.pack(_MAGIC, _VERSION, layout.fingerprint, bytes(32), layout.payload_nbytes, 0)
        kernel = None if isa is None else kv_record_kernel(None if isa == "auto" else isa)
        # Without hardware CRC32C the crc32c package (a call per record) checksums faster than the kernel.
        self._kernel: ShmRecords | None = None
        if kernel is not None and kernel.hw_crc:
            template = template.ljust(HEADER_NBYTES, b"\0")
            self._kernel = kernel.shm_records(self._records, template, _HASH_AT, _CRC_AT, self._noted_crcs)

    @classmethod
    def create_or_adopt(cls, name: str, layout: StoreLayout) -> ShmBlockStore:
        """A new segment, or the one a killed stage of this engine left (a restarted stage goes on with
        its records: the engine's index still offers the sealed ones). Either way this store owns it
        and removes it when closed for good (`unlink`)."""
        try:
            return cls(name, layout, create=True)
        except FileExistsError:
            store = cls(name, layout, create=False)
        resource_tracker.register(store._shm._name, "shared_memory")  # type: ignore[attr-defined]
        store._is_owner = True
        return store

    def _write(self, slot: int, header: bytes, data: np.ndarray) -> None:
        record = self._records[slot]
        self._noted_crcs[slot] = -1
        record[:HEADER_NBYTES] = 0  # invalid while the payload changes
        record[HEADER_NBYTES:] = data
        record[:HEADER_NBYTES] = np.frombuffer(header, dtype=np.uint8)

    # ---- in place: begin_write, copy into payload_records, seal; verify, copy out ---------
    def payload_records(self) -> PayloadRecords:
        """`[num_slots, payload_nbytes]` uint8 view of every record's payload, in the segment itself;
        valid until `close` (which unmaps it: keep no view beyond a call)."""
        return self._payloads

    def begin_write(self, slots: list[int]) -> None:
        """Zero these slots' headers and forget checksums noted for them: from here until `seal`, each
        reads as missing, however far a copy into its payload got (a cancelled or failed save leaves
        misses, never a mix)."""
        if self._kernel is not None:
            self._kernel.begin_write(slots)
            return
        for slot in slots:
            self._check_slot(slot)
        for slot in slots:
            self._noted_crcs[slot] = -1
            self._records[slot, :HEADER_NBYTES] = 0

    def seal(self, slots: list[int], block_hashes: list[bytes]) -> None:
        """Write each slot's header (last, after the payload), with the checksum noted for its payload
        since `begin_write`, else that of the payload as it is now."""
        if len(slots) != len(block_hashes):
            raise ValueError(f"{len(slots)} slots, {len(block_hashes)} block hashes")
        if self._kernel is not None:
            self._kernel.seal(slots, _joined(block_hashes))
            return
        buf, rec = self._shm.buf, self.layout.record_nbytes
        for slot, block_hash in zip(slots, block_hashes):
            self._check_slot(slot)
            start = slot * rec
            noted, self._noted_crcs[slot] = int(self._noted_crcs[slot]), -1
            payload = buf[start + HEADER_NBYTES : start + rec]
            buf[start : start + HEADER_NBYTES] = self._header(block_hash, payload, None if noted < 0 else noted)

    def verify(self, slots: list[int], block_hashes: list[bytes]) -> list[str | None]:
        """Per slot, None if its record holds that block intact (header and checksum), else why not."""
        return self._verify(slots, block_hashes, check_payload=True)[0]

    def check_headers(self, slots: list[int], block_hashes: list[bytes]) -> tuple[list[str | None], np.ndarray]:
        """Per slot, why its header does not fit that block (None if it does), without reading the payload;
        and the CRC32C each header holds (`[n]` uint32), which the payload must have where it fits."""
        return self._verify(slots, block_hashes, check_payload=False)

    def _verify(self, slots: list[int], block_hashes: list[bytes], check_payload: bool) -> tuple[list[str | None], np.ndarray]:
        if len(slots) != len(block_hashes):
            raise ValueError(f"{len(slots)} slots, {len(block_hashes)} block hashes")
        if self._kernel is None:
            reasons, crcs = [], np.zeros(len(slots), dtype=np.uint32)
            for i, (slot, block_hash) in enumerate(zip(slots, block_hashes)):
                self._check_slot(slot)
                record = self._records[slot]
                reason, crcs[i] = self._check_header(record[:HEADER_NBYTES].tobytes(), block_hash)
                if reason is None and check_payload and checksum(record[HEADER_NBYTES:]) != crcs[i]:
                    reason = "checksum mismatch"
                reasons.append(reason)
            return reasons, crcs
        status, crcs = self._kernel.verify(slots, _joined(block_hashes), check_payload)
        reasons: list[str | None] = [None] * len(slots)
        if status.any():  # a miss: rare, so each is read again, field by field, to say why
            for i in np.flatnonzero(status):
                header = self._records[slots[i], :HEADER_NBYTES].tobytes()
                reasons[i] = "checksum mismatch" if status[i] == 2 else self._check_header(header, block_hashes[i])[0]
        return reasons, crcs.copy()

    def write_many(self, slots: list[int], block_hashes: list[bytes], payloads: np.ndarray) -> None:
        self._check_rows(slots, block_hashes, payloads)
        self.begin_write(slots)
        whole_rows(self.payload_records())[np.asarray(slots, dtype=np.intp)] = whole_rows(payloads)
        self.seal(slots, block_hashes)

    def read_many_into(self, slots: list[int], block_hashes: list[bytes], out: np.ndarray) -> list[str | None]:
        # Checked in place, then copied: nothing writes a slot while it is read (one transfer thread
        # per store runs its jobs in turn, and the engine's index keeps a slot being loaded).
        self._check_rows(slots, block_hashes, out)
        reasons = self.verify(slots, block_hashes)
        good = [i for i, reason in enumerate(reasons) if reason is None]
        if good:
            records = whole_rows(self.payload_records())
            whole_rows(out)[good] = records[np.asarray([slots[i] for i in good], dtype=np.intp)]
        return reasons

    def _read_into(self, slot: int, block_hash: bytes, out: np.ndarray) -> str | None:
        record = self._records[slot]
        reason, crc = self._check_header(record[:HEADER_NBYTES].tobytes(), block_hash)
        if reason is not None:
            return reason
        out[:] = record[HEADER_NBYTES:]
        if checksum(out) != crc:
            return "checksum mismatch"
        return None

    def scan(self) -> dict[int, bytes]:
        found = {}
        for slot in range(self.layout.num_slots):
            header = self._records[slot, :HEADER_NBYTES].tobytes()
            if self._check_header(header, None)[0] is None:
                found[slot] = _HEADER.unpack_from(header)[3]
        return found

    def prefault(self) -> None:
        """Map every page of the segment now. A fresh segment's pages fault (and are zeroed) on their
        first write: while a store fills, that cost ~2% of a stage's CPU time in a workload with no
        reuse (SmolLM2, pp=2, 64 in / 64 out, in-process: 30k faults per 48 requests); once
        mapped, a save is only its copy. The offload worker prefaults its store at start-up (~0.7 s
        per GB here). ORs each page's first byte with 0 (numpy skips a plain self-copy)."""
        pages = self._records.reshape(-1)[:: mmap.PAGESIZE]
        np.bitwise_or(pages, 0, out=pages)

    def close(self) -> None:
        if self._records is not None:
            self._records = self._payloads = self._kernel = None  # the mapping cannot close while a view of it exists
            self._shm.close()

    def unlink(self) -> None:
        if not self._is_owner:  # unlink() unregisters it from the tracker: register it back first
            resource_tracker.register(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


class DirBlockStore(BlockStore):
    def __init__(self, directory: Path | str, layout: StoreLayout) -> None:
        super().__init__(layout)
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise OSError(f"KV store directory {self.directory} is not writable: {e}") from e

    def path(self, slot: int) -> Path:
        return self.directory / f"slot-{slot:08d}.kv"

    def _write(self, slot: int, header: bytes, data: np.ndarray) -> None:
        path = self.path(slot)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(memoryview(data))
        os.replace(tmp, path)

    def _read_into(self, slot: int, block_hash: bytes, out: np.ndarray) -> str | None:
        try:
            f = open(self.path(slot), "rb")
        except FileNotFoundError:
            return "missing"
        with f:
            header = f.read(HEADER_NBYTES)
            if len(header) < HEADER_NBYTES:
                return "truncated"
            reason, crc = self._check_header(header, block_hash)
            if reason is not None:
                return reason
            if f.readinto(memoryview(out)) != out.nbytes:
                return "truncated"
        if checksum(out) != crc:
            return "checksum mismatch"
        return None

    def scan(self) -> dict[int, bytes]:
        found = {}
        for path in self.directory.glob("slot-*.kv"):
            try:
                slot = int(path.stem.split("-")[1])
                with open(path, "rb") as f:
                    header = f.read(HEADER_NBYTES)
            except (ValueError, OSError):
                continue
            if slot >= self.layout.num_slots or len(header) < HEADER_NBYTES:
                continue
            if self._check_header(header, None)[0] is None:
                found[slot] = _HEADER.unpack_from(header)[3]
        return found
