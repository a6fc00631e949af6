"""One stage's offload store: `num_slots` fixed-size records, in shared memory or in files.

A record is a 128-byte header and one block's payload (`[num_layers, 2,
block_size, num_kv_heads, head_dim]`, raw bytes). The header holds a magic,
a format version, the layout's fingerprint (model, this stage's layers,
dtype, block size: a record written for anything else is a miss), the
block's hash, the payload size and its CRC32. `read_into` checks all of it
and returns why a record is unusable instead of raising: a missing,
truncated or corrupted block is a miss, never wrong KV.

* `ShmBlockStore`: one shared-memory segment; the payload is written first
  and the header last, so a half-written slot fails the check.
* `DirBlockStore`: one file per slot, written to a temporary file and
  renamed, so a crash never leaves a half record under a slot's name; the
  files outlive the engine (`scan` finds them at the next start).
Which hash lives in which slot is decided by the engine's `OffloadIndex`.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import torch

from asyncpp.dtypes import torch_dtype

HEADER_NBYTES = 128
_MAGIC = b"APKV"
_VERSION = 1
_HEADER = struct.Struct("<4sI32s32sQI")  # magic, version, fingerprint, block hash, payload bytes, crc32


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
    def _header(self, block_hash: bytes, data: np.ndarray) -> bytes:
        if len(block_hash) != 32:
            raise ValueError(f"block hash must be 32 bytes, got {len(block_hash)}")
        packed = _HEADER.pack(_MAGIC, _VERSION, self.layout.fingerprint, block_hash, data.nbytes, zlib.crc32(data))
        return packed.ljust(HEADER_NBYTES, b"\0")

    def _check_header(self, header: bytes, block_hash: bytes | None) -> tuple[str | None, int]:
        """(why the header is unusable or None, the payload's crc32)."""
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

    def _check_payload(self, payload: torch.Tensor) -> None:
        layout = self.layout
        if tuple(payload.shape) != layout.payload_shape or payload.dtype != torch_dtype(layout.dtype):
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype}, expected {layout.payload_shape} {layout.dtype}")
        if not payload.is_contiguous() or payload.device.type != "cpu":
            raise ValueError("payload must be a contiguous CPU tensor")


class ShmBlockStore(BlockStore):
    def __init__(self, name: str, layout: StoreLayout, create: bool) -> None:
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

    def _write(self, slot: int, header: bytes, data: np.ndarray) -> None:
        record = self._records[slot]
        record[:HEADER_NBYTES] = 0  # invalid while the payload changes
        record[HEADER_NBYTES:] = data
        record[:HEADER_NBYTES] = np.frombuffer(header, dtype=np.uint8)

    def _read_into(self, slot: int, block_hash: bytes, out: np.ndarray) -> str | None:
        record = self._records[slot]
        reason, crc = self._check_header(record[:HEADER_NBYTES].tobytes(), block_hash)
        if reason is not None:
            return reason
        out[:] = record[HEADER_NBYTES:]
        if zlib.crc32(out) != crc:
            return "checksum mismatch"
        return None

    def scan(self) -> dict[int, bytes]:
        found = {}
        for slot in range(self.layout.num_slots):
            header = self._records[slot, :HEADER_NBYTES].tobytes()
            if self._check_header(header, None)[0] is None:
                found[slot] = _HEADER.unpack_from(header)[3]
        return found

    def close(self) -> None:
        if self._records is not None:
            self._records = None  # the mapping cannot close while a view of it exists
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
        if zlib.crc32(out) != crc:
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
