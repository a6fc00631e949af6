"""Shared-memory ring on CPU: the receiver creates one segment, the sender maps it.

Layout: `[num_slots, num_keys, max_num_tokens, hidden_size]` in the model
dtype. Slot `step_id % num_slots` is safe to reuse because the engine keeps
at most `num_slots` steps in flight and a step is complete only when every
stage (so also the reader) has finished it.
"""

from __future__ import annotations

import math
from multiprocessing import shared_memory

import torch

from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.dtypes import ring_dtype
from asyncpp.transport.base import (
    ActivationNotice,
    RingSpec,
    check_notice,
    full_slots,
    outgoing_notice,
    register_transport,
    ring_shape,
    slot_views,
)


def _ring_tensor(shm: shared_memory.SharedMemory, spec: RingSpec) -> torch.Tensor:
    shape = ring_shape(spec)
    return torch.frombuffer(shm.buf, dtype=ring_dtype(spec.dtype), count=math.prod(shape)).view(shape)


def ring_nbytes(spec: RingSpec) -> int:
    return math.prod(ring_shape(spec)) * ring_dtype(spec.dtype).itemsize


class ShmReceiver:
    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        self._shm = shared_memory.SharedMemory(name=spec.name, create=True, size=ring_nbytes(spec))
        self.ring = _ring_tensor(self._shm, spec)
        self.ring.zero_()

    def view(self, notice: ActivationNotice) -> IntermediateTensors:
        check_notice(self.spec, notice)
        return slot_views(self.ring, self.spec, notice.slot, notice.num_tokens)

    def release(self, slot: int) -> None:
        """Nothing to do: the CPU forward that read the slot is over when this is called."""

    def slots(self) -> list[IntermediateTensors]:
        return full_slots(self.ring, self.spec)

    def close(self) -> None:
        del self.ring
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


class ShmSender:
    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        # Stages are spawned by one launcher and share its resource tracker, so this
        # attach re-registers a name the tracker already holds (a set): harmless, and
        # the receiver's unlink removes it. Unregistering here would make that fail.
        self._shm = shared_memory.SharedMemory(name=spec.name, create=False)
        self.ring = _ring_tensor(self._shm, spec)

    def write(self, step_id: int, tensors: IntermediateTensors) -> ActivationNotice:
        notice = outgoing_notice(self.spec, step_id, tensors)
        slot = slot_views(self.ring, self.spec, notice.slot, notice.num_tokens)
        for key in self.spec.keys:
            slot[key].copy_(tensors[key])
        return notice

    def close(self) -> None:
        del self.ring
        self._shm.close()


register_transport("shm", ShmReceiver, ShmSender)
