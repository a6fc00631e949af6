"""KV caches of the layers two neighbouring stages both hold (`parallel.shift_layers`).

A step may run such a layer on either stage, so its K and V must be one buffer
that both stages read and write. In-process stages simply share the tensors.
Stage processes map one shared-memory segment per window. The engine creates
it (it outlives the stages) once the block count is agreed, and unlinks it at
exit. A cohort's steps run in order through the stages, and two cohorts never
touch the same blocks, so no layer's cache is ever written by two stages at
once.

Segment layout: `[2 (K, V), num_layers, num_slots, num_kv_heads, head_dim]`, so
each layer's K and V are contiguous, as the decode kernel needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from asyncpp.dtypes import torch_dtype


@dataclass(frozen=True)
class SharedKVSpec:
    """One window's segment: layers [first_layer, first_layer + num_layers)."""

    name: str  # POSIX shared-memory name
    first_layer: int
    num_layers: int
    num_slots: int  # num_blocks * block_size
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize


def layer_views(buffer: torch.Tensor, first_layer: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Global layer index -> (K, V) views of a `[2, num_layers, ...]` buffer."""
    return {first_layer + i: (buffer[0, i], buffer[1, i]) for i in range(buffer.shape[1])}


def allocate_shared_kv(specs: list[SharedKVSpec]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """In-process stages: plain tensors that both neighbours get."""
    caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for spec in specs:
        caches.update(layer_views(torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype)), spec.first_layer))
    return caches


class SharedKVSegment:
    """One window's shared memory: `create` in the engine, `attach` in each of the two stages."""

    def __init__(self, spec: SharedKVSpec, create: bool) -> None:
        self.spec = spec
        # Stages share the launcher's resource tracker: an attach re-registers a name it holds
        # (a set), and the creator's unlink removes it (as the activation ring does).
        self._shm = shared_memory.SharedMemory(name=spec.name, create=create, size=spec.nbytes if create else 0)
        if self._shm.size < spec.nbytes:
            self._shm.close()
            raise ValueError(f"shared KV segment {spec.name}: {self._shm.size} bytes, need {spec.nbytes}")
        self.is_owner = create
        self.buffer = torch.frombuffer(self._shm.buf, dtype=torch_dtype(spec.dtype), count=math.prod(spec.shape))
        self.buffer = self.buffer.view(spec.shape)

    @staticmethod
    def create(spec: SharedKVSpec) -> "SharedKVSegment":
        return SharedKVSegment(spec, create=True)  # fresh POSIX shared memory reads as zeros

    @staticmethod
    def attach(spec: SharedKVSpec) -> "SharedKVSegment":
        return SharedKVSegment(spec, create=False)

    def caches(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return layer_views(self.buffer, self.spec.first_layer)

    def close(self) -> None:
        del self.buffer
        try:
            self._shm.close()
        except BufferError:  # a runner still holds views: the mapping goes with the process
            pass
        if self.is_owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


def shared_kv_specs(
    windows: list[tuple[int, int]], names: list[str], num_slots: int, num_kv_heads: int, head_dim: int, dtype: str
) -> list[SharedKVSpec]:
    """One spec per window that holds layers (lowest < highest)."""
    return [
        SharedKVSpec(name, lo, hi - lo, num_slots, num_kv_heads, head_dim, dtype)
        for (lo, hi), name in zip(windows, names, strict=True)
        if hi > lo
    ]
