"""Shared-memory ring on CPU: the receiver creates one segment, the sender maps it.

Layout: `[num_slots, num_keys, max_num_tokens, hidden_size]` in the model
dtype. Slot `step_id % num_slots` is safe to reuse because the engine keeps
at most `num_slots` steps in flight and a step is complete only when every
stage (so also the reader) has finished it.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import torch

from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.dtypes import torch_dtype
from asyncpp.transport.base import ActivationNotice, RingSpec, check_notice, register_transport, slot_views


def _ring_tensor(shm: shared_memory.SharedMemory, spec: RingSpec) -> torch.Tensor:
    dtype = torch_dtype(spec.dtype)
    shape = (spec.num_slots, len(spec.keys), spec.max_num_tokens, spec.hidden_size)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    return torch.frombuffer(shm.buf, dtype=dtype, count=numel).view(shape)


def ring_nbytes(spec: RingSpec) -> int:
    elem = torch_dtype(spec.dtype).itemsize
    return spec.num_slots * len(spec.keys) * spec.max_num_tokens * spec.hidden_size * elem


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
        return [slot_views(self.ring, self.spec, s, self.spec.max_num_tokens) for s in range(self.spec.num_slots)]

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
        keys = list(tensors.keys())
        notice = ActivationNotice(step_id, step_id % self.spec.num_slots, tensors.num_tokens, keys)
        check_notice(self.spec, notice)  # refuse to write what the receiver would reject
        slot = self.ring[notice.slot]
        for i, key in enumerate(self.spec.keys):
            slot[i, : notice.num_tokens].copy_(tensors[key])
        return notice

    def close(self) -> None:
        del self.ring
        self._shm.close()


register_transport("shm", ShmReceiver, ShmSender)
