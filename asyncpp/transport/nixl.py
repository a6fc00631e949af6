"""NIXL ring between stages on different hosts: the receiver registers its ring once, the sender writes into it.

The receiver allocates the usual `[num_slots, num_keys, max_num_tokens,
hidden_size]` ring, registers it with its own NIXL agent (the PD wrapper,
`asyncpp.transport.nixl_agent.NixlTransport`, UCX backend) and
publishes the agent's metadata and the ring's address in `RingSpec.handles`.
The sender registers a ring of the same shape as its staging buffer, adds the
receiver's agent, and per step copies its tensors into its own slot and posts
ONE NIXL WRITE (one descriptor per key) into the same slot on the receiver,
carrying the step id as its notification. It waits until the write completed
before the step's notice goes out on the control plane; the receiver, given
the notice, waits for the NIXL notification of that step, which NIXL delivers
only after every byte of the write has landed, so a notice never outruns its
data. A write that fails (the peer is gone) fails the step on both sides:
the sender raises, and the receiver, which then gets no notification, gives
up after `NOTIF_TIMEOUT_S`.

UCX picks its transports itself (RDMA and GPU memory where present, TCP on
plain networks); `UCX_TLS=tcp` forces TCP, which the tests do even between
processes on one machine. CPU memory only for now: a CUDA ring would register
device memory the same way but is untested without a GPU.
"""

from __future__ import annotations

import dataclasses
import time

import msgpack
import torch

from asyncpp.dtypes import ring_dtype
from asyncpp.transport.nixl_agent import NixlTransport, TransferState
from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.transport.base import (
    ActivationError,
    ActivationNotice,
    RingSpec,
    check_notice,
    full_slots,
    outgoing_notice,
    register_transport,
    ring_shape,
    slot_views,
)

NOTIF_TIMEOUT_S = 30.0  # a notice whose data never arrives fails its step after this long
WRITE_TIMEOUT_S = 30.0
_SPIN_S = 20e-6
_PROGRESS_DELAY_US = 1000  # NIXL progress thread: a hand-off waits on it, a KV pull (5 ms) does not


def _ring(spec: RingSpec) -> torch.Tensor:
    return torch.zeros(ring_shape(spec), dtype=ring_dtype(spec.dtype))


def _step_notif(step_id: int) -> bytes:
    return b"act:%d" % step_id


class NixlReceiver:
    def __init__(self, spec: RingSpec) -> None:
        if spec.device != "cpu" or spec.peer_device != "cpu":
            raise ValueError("the nixl activation transport moves CPU memory only (for now)")
        self.ring = _ring(spec)
        self._agent = NixlTransport(spec.name, progress_delay_us=_PROGRESS_DELAY_US)
        self._agent.register([self.ring])
        handles = msgpack.packb({"agent": self._agent.agent_metadata(), "addr": self.ring.data_ptr()})
        self.spec = dataclasses.replace(spec, handles=handles)
        self._arrived: set[int] = set()  # steps whose write landed and whose notice is not yet read

    def view(self, notice: ActivationNotice) -> IntermediateTensors:
        check_notice(self.spec, notice)
        self._wait_for(notice.step_id)
        return slot_views(self.ring, self.spec, notice.slot, notice.num_tokens)

    def _wait_for(self, step_id: int) -> None:
        deadline = time.monotonic() + NOTIF_TIMEOUT_S
        while step_id not in self._arrived:
            for msg in self._agent.get_notifs():
                if msg.startswith(b"act:"):
                    self._arrived.add(int(msg[4:]))
            if step_id in self._arrived:
                break
            if time.monotonic() > deadline:
                raise ActivationError(f"step {step_id}: its activations did not arrive within {NOTIF_TIMEOUT_S} s")
            time.sleep(_SPIN_S)
        self._arrived.discard(step_id)

    def release(self, slot: int) -> None:
        """Nothing to do: the CPU forward that read the slot is over when this is called."""

    def slots(self) -> list[IntermediateTensors]:
        return full_slots(self.ring, self.spec)

    def close(self) -> None:
        self._agent.close()


class NixlSender:
    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        handles = msgpack.unpackb(spec.handles)
        self._remote_addr = int(handles["addr"])
        self.staging = _ring(spec)  # registered once: a write's source must be NIXL memory
        self._agent = NixlTransport(f"{spec.name}-writer", progress_delay_us=_PROGRESS_DELAY_US)
        self._agent.register([self.staging])
        self._remote = self._agent.add_remote(handles["agent"])
        self._itemsize = self.staging.element_size()

    def write(self, step_id: int, tensors: IntermediateTensors) -> ActivationNotice:
        notice = outgoing_notice(self.spec, step_id, tensors)
        slot = slot_views(self.staging, self.spec, notice.slot, notice.num_tokens)
        runs = []
        for key in self.spec.keys:
            slot[key].copy_(tensors[key])
            offset = slot[key].data_ptr() - self.staging.data_ptr()
            runs.append((slot[key].data_ptr(), self._remote_addr + offset, slot[key].numel() * self._itemsize))
        handle = self._agent.write(self._remote, runs, _step_notif(step_id))
        try:
            deadline = time.monotonic() + WRITE_TIMEOUT_S
            while (state := self._agent.poll(handle)) is TransferState.RUNNING:
                if time.monotonic() > deadline:
                    raise ActivationError(f"step {step_id}: the NIXL write still runs after {WRITE_TIMEOUT_S} s")
                time.sleep(_SPIN_S)
            if state is TransferState.FAILED:
                raise ActivationError(f"step {step_id}: the NIXL write to {self._remote!r} failed")
        finally:
            self._agent.release(handle)
        return notice

    def close(self) -> None:
        self._agent.close()


register_transport("nixl", NixlReceiver, NixlSender)
