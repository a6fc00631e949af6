"""Read a GGUF file's header: key/value metadata and tensor infos, memory-mapped.

Contract: `read_gguf_metadata(path)` returns `{key: value}` for every metadata
entry, with strings as `str`, numbers and bools as Python scalars and arrays as
Python lists. `GGUFFile(path)` also reads the tensor infos and hands out each
tensor's raw bytes as a numpy view of the memory map (`raw(name)`), ready for
`gguf.quants.dequantize`. A missing file raises `FileNotFoundError`; a file
that is not GGUF v2/v3, or ends inside the header or a tensor, raises
`ValueError`; both messages name the file.

Why not `gguf.GGUFReader`: it wraps every array element in its own numpy
memmap view, so the ~100k strings of a tokenizer (tokens + merges) take 4-7 s
to read; walking the same bytes with `struct` takes well under a second. We
still take the value-type codes from the `gguf` package (the format's
reference implementation) rather than restating them.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; nothing current writes it

# struct format letter and numpy dtype per scalar value type (byte order added later).
_SCALAR_FORMATS: dict[GGUFValueType, tuple[str, str]] = {
    GGUFValueType.UINT8: ("B", "u1"),
    GGUFValueType.INT8: ("b", "i1"),
    GGUFValueType.UINT16: ("H", "u2"),
    GGUFValueType.INT16: ("h", "i2"),
    GGUFValueType.UINT32: ("I", "u4"),
    GGUFValueType.INT32: ("i", "i4"),
    GGUFValueType.FLOAT32: ("f", "f4"),
    GGUFValueType.BOOL: ("?", "?"),
    GGUFValueType.UINT64: ("Q", "u8"),
    GGUFValueType.INT64: ("q", "i8"),
    GGUFValueType.FLOAT64: ("d", "f8"),
}


class _Cursor:
    """A read position in the file's bytes; every read advances it."""

    def __init__(self, buf: memoryview, byte_order: str) -> None:
        self.buf = buf
        self.byte_order = byte_order  # "<" or ">"
        self.offset = 0
        self.num_tensors = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.byte_order + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        num_bytes = self.scalar("Q")
        end = self.offset + num_bytes
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        # errors="replace": a few GGUF vocabularies hold invalid UTF-8; the
        # reference reader tolerates them too.
        text = bytes(self.buf[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALAR_FORMATS[value_type][0])

    def array(self) -> list[Any]:
        item_type = GGUFValueType(self.scalar("I"))
        num_items = self.scalar("Q")
        if item_type in _SCALAR_FORMATS:
            # Numeric arrays (token types, scores) in one numpy read instead of a Python loop.
            dtype = np.dtype(self.byte_order + _SCALAR_FORMATS[item_type][1])
            num_bytes = num_items * dtype.itemsize
            if self.offset + num_bytes > len(self.buf):
                raise struct.error("array runs past the end of the file")
            items = np.frombuffer(self.buf, dtype, num_items, self.offset).tolist()
            self.offset += num_bytes
            return items
        return [self.value(item_type) for _ in range(num_items)]


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata key/value of the GGUF file at `path`."""
    path = os.fspath(path)
    with _open(path) as mapped:
        buf = memoryview(mapped)
        try:
            return _read_metadata(buf, path)[0]
        finally:
            buf.release()  # the mmap refuses to close while a view is exported


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class GGUFFile:
    """A GGUF file's metadata and tensor infos; tensor bytes stay in the memory map."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with _open(self.path) as mapped:
            buf = memoryview(mapped)
            try:
                self.metadata, cursor = _read_metadata(buf, self.path)
                self.tensors = _read_tensor_infos(cursor, self.metadata, self.path, len(buf))
            finally:
                buf.release()
        # numpy keeps its own read-only map of the data for `raw`.
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """`[rows, bytes_per_row]` uint8 view of one tensor, the layout `gguf.quants.dequantize` takes."""
        rows = int(np.prod(info.shape[1:], dtype=np.int64)) if len(info.shape) > 1 else 1
        return self._data[info.offset : info.offset + info.num_bytes].reshape(rows, -1)


def _open(path: str) -> mmap.mmap:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:  # magic + version + two counts
            raise ValueError(f"{path} is not a GGUF file: too short")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _read_tensor_infos(cursor: "_Cursor", metadata: dict[str, Any], path: str, file_size: int) -> dict[str, GGUFTensorInfo]:
    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    try:
        for _ in range(cursor.num_tensors):
            name = cursor.string()
            num_dims = cursor.scalar("I")
            shape = tuple(cursor.scalar("Q") for _ in range(num_dims))
            qtype = GGMLQuantizationType(cursor.scalar("I"))
            infos.append((name, shape, qtype, cursor.scalar("Q")))
    except (struct.error, ValueError) as e:
        raise ValueError(f"{path}: corrupt GGUF tensor infos after {len(infos)} tensors ({e})") from e
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        num_elements = int(np.prod(shape, dtype=np.int64))
        num_bytes = num_elements // block_size * type_size
        start = data_start + offset
        if start + num_bytes > file_size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, num_bytes)
    return tensors


def _read_metadata(buf: memoryview, path: str) -> tuple[dict[str, Any], "_Cursor"]:
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file: magic {bytes(buf[:4])!r}")
    # The version is small, so a little-endian read with empty low bytes means
    # the file was written big-endian.
    (version,) = struct.unpack_from("<I", buf, 4)
    byte_order = "<" if version & 0xFFFF else ">"
    cursor = _Cursor(buf, byte_order)
    cursor.offset = 4
    version = cursor.scalar("I")
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    cursor.num_tensors = cursor.scalar("Q")
    num_kv = cursor.scalar("Q")
    metadata: dict[str, Any] = {}
    try:
        for _ in range(num_kv):
            key = cursor.string()
            metadata[key] = cursor.value(GGUFValueType(cursor.scalar("I")))
    except (struct.error, ValueError) as e:  # ValueError: an unknown value-type code
        raise ValueError(f"{path}: corrupt GGUF metadata after {len(metadata)} keys ({e})") from e
    return metadata, cursor
