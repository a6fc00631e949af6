"""CUDA IPC ring: the receiver allocates its ring on its GPU, the sender writes into it from its own process.

Start-up (once; creating IPC handles is slow):
* the receiver allocates `[num_slots, num_keys, max_num_tokens, hidden_size]`
  on its device, and two interprocess CUDA events per slot: `written` (on
  the sender's device: the sender records it) and `released` (on its own:
  it records it);
* it puts the ring's memory handle (torch's `_share_cuda_` tuple: ints and
  bytes, the offset inside the allocator's segment included) and the
  events' handles into `RingSpec.handles` as msgpack bytes, never pickle;
* the sender rebuilds the ring and opens the events.

Per step, with no host synchronisation on either side:
* sender: its stream waits for the slot's `released`, copies the
  activations into the slot, records `written`, sends the usual notice;
* receiver: checks the notice, makes its stream wait for `written`, runs the
  forward reading the slot in place (the slots are its CUDA graphs' inputs),
  then records `released`.

Why the host order is enough: the sender writes slot `s` again only for a
step `num_slots` later, which the engine schedules after every stage,
the receiver included, has reported the step that read `s`, and the
receiver records `released` before it reports. A wait is enqueued after
the record it must see, so it sees it.
"""

from __future__ import annotations

import dataclasses

import msgpack
import torch

from asyncpp.device import indexed_device, is_cuda
from asyncpp.dtypes import ring_dtype
from asyncpp.model.intermediate import IntermediateTensors
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


def _event_on(device: torch.device) -> torch.cuda.Event:
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)  # no timing: interprocess events cannot time
        event.record()  # created now, on `device`; a wait on it returns at once until it is recorded again
    return event


class CudaIpcReceiver:
    def __init__(self, spec: RingSpec) -> None:
        if not (is_cuda(spec.device) and is_cuda(spec.peer_device)):
            raise ValueError(f"cuda_ipc needs CUDA stages, got ring on {spec.device!r}, sender on {spec.peer_device!r}")
        self.device, peer = indexed_device(spec.device), indexed_device(spec.peer_device)
        self.ring = torch.zeros(ring_shape(spec), dtype=ring_dtype(spec.dtype), device=self.device)
        self.written = [_event_on(peer) for _ in range(spec.num_slots)]
        self.released = [_event_on(self.device) for _ in range(spec.num_slots)]
        torch.cuda.synchronize(self.device)
        handles = {
            "storage": list(self.ring.untyped_storage()._share_cuda_()),
            "written": [e.ipc_handle() for e in self.written],
            "released": [e.ipc_handle() for e in self.released],
        }
        self.spec = dataclasses.replace(spec, handles=msgpack.packb(handles, use_bin_type=True))

    def view(self, notice: ActivationNotice) -> IntermediateTensors:
        check_notice(self.spec, notice)
        torch.cuda.current_stream(self.device).wait_event(self.written[notice.slot])
        return slot_views(self.ring, self.spec, notice.slot, notice.num_tokens)

    def release(self, slot: int) -> None:
        self.released[slot].record(torch.cuda.current_stream(self.device))

    def slots(self) -> list[IntermediateTensors]:
        return full_slots(self.ring, self.spec)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.written, self.released = [], []
        del self.ring


class CudaIpcSender:
    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        ring_device, self.device = indexed_device(spec.device), indexed_device(spec.peer_device)
        handles = msgpack.unpackb(spec.handles, raw=False)
        torch.zeros(1, device=self.device)  # CUDA must be initialised before opening a handle (else it crashes)
        storage = torch.UntypedStorage._new_shared_cuda(*handles["storage"])
        shape = ring_shape(spec)
        strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
        self.ring = torch.empty(0, dtype=ring_dtype(spec.dtype), device=ring_device).set_(storage, 0, shape, strides)
        self.written = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in handles["written"]]
        self.released = [torch.cuda.Event.from_ipc_handle(ring_device, h) for h in handles["released"]]

    def write(self, step_id: int, tensors: IntermediateTensors) -> ActivationNotice:
        notice = outgoing_notice(self.spec, step_id, tensors)
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.released[notice.slot])  # the receiver's last read of this slot is done
        slot = slot_views(self.ring, self.spec, notice.slot, notice.num_tokens)
        for key in self.spec.keys:
            slot[key].copy_(tensors[key], non_blocking=True)
        self.written[notice.slot].record(stream)
        return notice

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.written, self.released = [], []
        del self.ring


register_transport("cuda_ipc", CudaIpcReceiver, CudaIpcSender)
