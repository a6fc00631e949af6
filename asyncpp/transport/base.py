"""The activation transport contract and its registry.

The RECEIVING stage owns a ring of persistent buffers (one slot per in-flight
step) for the key set agreed at start-up, each `[max_num_tokens, hidden]`.
It publishes a `RingSpec` once; the sending stage attaches to it and writes
its `IntermediateTensors` straight into a slot. Per step only an
`ActivationNotice` travels on the control plane. The receiver checks the
notice against the agreed keys and capacity and fails the step with
`ActivationError` on any mismatch.

A transport registers a receiver class (`create(spec) -> Receiver`) and a
sender class (`attach(spec) -> Sender`): `shm` (CPU) and `cuda_ipc` (CUDA);
a torch.distributed backend would plug in here without touching the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.wire.codec import message


class ActivationError(ValueError):
    """A notice that does not match the ring agreed at start-up."""


@dataclass(frozen=True)
class RingSpec:
    """Everything a sender needs to attach to a receiver's ring (sent once, at start-up)."""

    transport: str
    name: str  # shared-memory segment name (shm) or handle id
    keys: list[str]
    num_slots: int
    max_num_tokens: int
    hidden_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"; "int64" for a token ring
    device: str = "cpu"  # where the ring lives (the receiver's device)
    peer_device: str = "cpu"  # the sender's device
    handles: bytes = b""  # transport-specific, msgpack (cuda_ipc: memory and event IPC handles)


@message("activation_notice")
@dataclass(frozen=True)
class ActivationNotice:
    step_id: int
    slot: int
    num_tokens: int
    keys: list[str]


class Receiver(Protocol):
    spec: RingSpec

    def view(self, notice: ActivationNotice) -> IntermediateTensors: ...
    def release(self, slot: int) -> None: ...  # the step reading `slot` is enqueued: it may be rewritten after it
    def slots(self) -> list[IntermediateTensors]: ...  # every slot, full size (the graphs' input addresses)
    def close(self) -> None: ...


class Sender(Protocol):
    spec: RingSpec

    def write(self, step_id: int, tensors: IntermediateTensors) -> ActivationNotice: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    create_receiver: type
    attach_sender: type


TRANSPORTS: dict[str, Transport] = {}


def register_transport(name: str, receiver: type, sender: type) -> None:
    TRANSPORTS[name] = Transport(receiver, sender)


def get_transport(name: str) -> Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown activation transport {name!r}; known: {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


def ring_shape(spec: RingSpec) -> tuple[int, int, int, int]:
    """`[num_slots, num_keys, max_num_tokens, hidden_size]`, the layout of every transport's ring."""
    return (spec.num_slots, len(spec.keys), spec.max_num_tokens, spec.hidden_size)


def outgoing_notice(spec: RingSpec, step_id: int, tensors: IntermediateTensors) -> ActivationNotice:
    """The notice for writing `tensors` of `step_id`; refuses (like the receiver would) what does not fit."""
    notice = ActivationNotice(step_id, step_id % spec.num_slots, tensors.num_tokens, list(tensors.keys()))
    check_notice(spec, notice)
    return notice


def slot_views(ring, spec: RingSpec, slot: int, num_tokens: int) -> IntermediateTensors:
    """The first `num_tokens` rows of every key of `slot` of a `[slots, keys, tokens, hidden]` ring."""
    return IntermediateTensors({k: ring[slot, i, :num_tokens] for i, k in enumerate(spec.keys)})


def full_slots(ring, spec: RingSpec) -> list[IntermediateTensors]:
    """Every slot at full size: the addresses a receiver's CUDA graphs read."""
    return [slot_views(ring, spec, s, spec.max_num_tokens) for s in range(spec.num_slots)]


def check_notice(spec: RingSpec, notice: ActivationNotice) -> None:
    """Fail loudly on anything but the agreed key set and a fitting size."""
    if list(notice.keys) != list(spec.keys):
        raise ActivationError(
            f"step {notice.step_id}: activation keys {list(notice.keys)} differ from the agreed {list(spec.keys)}"
        )
    if not 0 < notice.num_tokens <= spec.max_num_tokens:
        raise ActivationError(
            f"step {notice.step_id}: {notice.num_tokens} tokens do not fit the ring's {spec.max_num_tokens}-token slots"
        )
    if not 0 <= notice.slot < spec.num_slots:
        raise ActivationError(f"step {notice.step_id}: slot {notice.slot} outside the ring's {spec.num_slots} slots")

