"""Sampled tokens from the last stage to the first through a ring on the first stage's device.

With async scheduling a cohort's next step is scheduled with placeholders for
the tokens its current step samples, and the last stage hands those tokens
straight to the first (`SampledTokens`). On the host path the last stage
waits for its device, lists the tokens and sends them, and the first stage
copies them back to its device: on GPUs a round trip through both hosts
between two steps of a cohort, with the device idle meanwhile.

The ring path moves them device to device instead. The first stage owns a
one-key activation ring, `[num_slots, 1, max_num_reqs, 1]` int64, created
with the stages' activation transport (`cuda_ipc` on GPUs; `shm` on CPUs,
where it only exercises the same protocol). The last stage writes a step's
sampled tokens, still on its device, into slot `step_id % num_slots` and
sends `SampledTokens` with that slot and no token ids, before it waits for
its device; the first stage, taking the notice, makes its stream wait for
the write, copies the slot into a tensor of its own and releases the slot.
The host learns the tokens from the last stage's `StageOutput`, as before.
Steps that sample with drafts, logprobs, penalties or seeds go the host path.

Reuse of a slot: before running plan K the first stage takes every notice up
to step K - num_slots (`TokenInbox`). The last stage writes step N's tokens
after the first stage ran plan N (it needs N's activations), so the step
that used the slot before, at most N - num_slots, was taken and its slot
released by then; on CUDA the write's stream waits for that release. With
num_slots at least the steps in flight, step K - num_slots is complete when
K is dispatched, so that wait never stalls the first stage.
"""

from __future__ import annotations

import torch

from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.transport.base import ActivationNotice, RingSpec, get_transport

TOKENS_KEY = "sampled_token_ids"


def token_ring_spec(
    name: str, transport: str, num_slots: int, max_num_reqs: int, device: str, peer_device: str
) -> RingSpec:
    """The first stage's token ring: one int64 per request of a step, `num_slots` steps."""
    return RingSpec(
        transport=transport,
        name=name,
        keys=[TOKENS_KEY],
        num_slots=num_slots,
        max_num_tokens=max_num_reqs,
        hidden_size=1,
        dtype="int64",
        device=device,
        peer_device=peer_device,
    )


class TokenRingReader:
    """The first stage's end: creates the ring; `take` copies a step's tokens out and frees the slot."""

    def __init__(self, spec: RingSpec) -> None:
        self.receiver = get_transport(spec.transport).create_receiver(spec)
        self.spec = self.receiver.spec  # with the transport's handles

    def take(self, step_id: int, slot: int, num_reqs: int) -> torch.Tensor:
        """Step `step_id`'s `num_reqs` tokens, copied (after the writer's write, on the device) into a
        tensor of their own; the slot may be written again after this."""
        notice = ActivationNotice(step_id, slot, num_reqs, [TOKENS_KEY])
        tokens = self.receiver.view(notice)[TOKENS_KEY][:, 0].clone()
        self.receiver.release(slot)
        return tokens

    def close(self) -> None:
        self.receiver.close()


class TokenRingWriter:
    """The last stage's end: writes a step's sampled tokens, a `[num_reqs]` tensor on its device."""

    def __init__(self, spec: RingSpec) -> None:
        self.sender = get_transport(spec.transport).attach_sender(spec)

    def write(self, step_id: int, token_ids: torch.Tensor) -> int:
        """Write `token_ids` for `step_id`; its slot (raises `ActivationError` if they do not fit)."""
        notice = self.sender.write(step_id, IntermediateTensors({TOKENS_KEY: token_ids.view(-1, 1)}))
        return notice.slot

    def close(self) -> None:
        self.sender.close()
