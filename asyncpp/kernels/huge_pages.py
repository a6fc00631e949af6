"""Packed weights on transparent huge pages.

A stage streams all its packed weights (tens of MB) from memory every step. On 4 KB pages that
is one TLB entry per 4 KB, far more than the TLB holds, so the kernels' loads keep waiting on page
walks; on 2 MB pages a stage's weights need a few dozen entries. Linux backs anonymous memory with
huge pages where the process asks for them (`madvise(MADV_HUGEPAGE)`, what
`/sys/kernel/mm/transparent_hugepage/enabled = madvise`, a common default, requires) or everywhere
(`always`). The pack functions of the CPU kernels take their output tensors from `weight_buffer`,
which carves them out of 2 MB-aligned anonymous mappings advised that way. Only the placement
changes: the same bytes, so the same bits.

Tensors are bump-allocated from chunks of `CHUNK_BYTES`; a request larger than a quarter chunk
gets a mapping of its own. A chunk is unmapped once no tensor in it (and not the allocator, which
keeps only its current chunk) refers to it. Where huge pages do not apply (not Linux,
`ASYNCPP_DISABLE_HUGE_PAGES=1`) `weight_buffer` is `torch.empty`. `zeros` gives large zero-filled
buffers (the KV caches) a mapping of their own the same way.
"""

from __future__ import annotations

import math
import mmap
import os
import threading

import torch

HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
CHUNK_BYTES = 32 << 20
ALIGN = 64  # every tensor starts on a cache line


def enabled() -> bool:
    """Whether `weight_buffer` places tensors on huge-page-advised mappings here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("ASYNCPP_DISABLE_HUGE_PAGES", "0") in ("", "0")


class _Mapping:
    """One anonymous mapping advised for huge pages, used from its first 2 MB boundary."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        base = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        self.start = -base % HUGE_PAGE  # offset of the first 2 MB boundary
        self.end = self.start + nbytes
        self.used = self.start

    def take(self, nbytes: int) -> torch.Tensor | None:
        offset = -(-self.used // ALIGN) * ALIGN
        if offset + nbytes > self.end:
            return None
        self.used = offset + nbytes
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=offset)


def _own_mapping(nbytes: int) -> torch.Tensor:
    """A `[nbytes]` uint8 tensor on a mapping of its own, whole huge pages (fresh: it reads as zeros)."""
    out = _Mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE).take(nbytes)
    assert out is not None
    return out


class HugePageArena:
    """Bump allocator of uint8 tensors over huge-page-advised chunks (see the module doc)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes <= 0 or chunk_bytes % HUGE_PAGE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {HUGE_PAGE}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunk: _Mapping | None = None
        self._lock = threading.Lock()

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised `[nbytes]` uint8 tensor, 64-byte aligned, on huge-page-advised memory."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if nbytes > self.chunk_bytes // 4:
            return _own_mapping(nbytes)
        with self._lock:
            out = self._chunk.take(nbytes) if self._chunk is not None else None
            if out is None:
                self._chunk = _Mapping(self.chunk_bytes)
                out = self._chunk.take(nbytes)
        assert out is not None
        return out


_ARENA = HugePageArena()


def weight_buffer(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised 1-D tensor of `nbytes` bytes viewed as `dtype`, for a packed weight: on
    huge-page-advised memory where `enabled()`, else from `torch.empty`."""
    itemsize = dtype.itemsize
    if nbytes % itemsize:
        raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements")
    if not enabled():
        return torch.empty(nbytes // itemsize, dtype=dtype)
    return _ARENA.empty(nbytes).view(dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor on a huge-page-advised mapping of its own: for large buffers read all over,
    such as KV caches. A fresh anonymous mapping reads as zeros; its pages are faulted in here, one
    write a page, so that no serving step pays for them (left to the first write, the kernel's zeroing
    of KV cache huge pages took 2-4% of a stage's time over a new server's first long prompts).
    `torch.zeros` where not `enabled()` or below one huge page."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not enabled() or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    out = _own_mapping(nbytes)
    out[::PAGE].zero_()
    return out.view(dtype).view(shape)
