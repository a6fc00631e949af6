"""The shared-memory activation ring: one copy in, a zero-copy view out, loud errors on any mismatch."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from asyncpp.model.intermediate import INTERMEDIATE_KEYS, IntermediateTensors
from asyncpp.transport import ActivationError, ActivationNotice, RingSpec, get_transport
from asyncpp.transport.shm import ShmReceiver, ShmSender, ring_nbytes

HIDDEN = 24
MAX_TOKENS = 32
NUM_SLOTS = 3


def make_spec(dtype: str = "float32", **overrides) -> RingSpec:
    values = dict(
        transport="shm",
        name=f"asyncpp-test-{uuid.uuid4().hex[:10]}",
        keys=list(INTERMEDIATE_KEYS),
        num_slots=NUM_SLOTS,
        max_num_tokens=MAX_TOKENS,
        hidden_size=HIDDEN,
        dtype=dtype,
    )
    values.update(overrides)
    return RingSpec(**values)


@pytest.fixture
def ring(request):
    """(receiver, sender) on a fresh segment; both closed and the segment unlinked afterwards."""
    spec = make_spec(getattr(request, "param", "float32"))
    transport = get_transport("shm")
    receiver = transport.create_receiver(spec)
    sender = transport.attach_sender(spec)
    yield receiver, sender
    sender.close()
    receiver.close()
    assert not Path(f"/dev/shm/{spec.name}").exists()


def random_tensors(num_tokens: int, dtype: torch.dtype, seed: int) -> IntermediateTensors:
    g = torch.Generator().manual_seed(seed)
    return IntermediateTensors(
        {k: torch.randn(num_tokens, HIDDEN, generator=g).to(dtype) for k in INTERMEDIATE_KEYS}
    )


def test_registry_knows_shm_and_refuses_unknown():
    transport = get_transport("shm")
    assert transport.create_receiver is ShmReceiver and transport.attach_sender is ShmSender
    with pytest.raises(ValueError, match="unknown activation transport 'carrier-pigeon'"):
        get_transport("carrier-pigeon")


@pytest.mark.parametrize("ring,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)], indirect=["ring"])
def test_write_then_view_is_identical(ring, dtype):
    receiver, sender = ring
    assert Path(f"/dev/shm/{receiver.spec.name}").stat().st_size >= ring_nbytes(receiver.spec)
    for step_id, num_tokens in [(0, 1), (1, 7), (2, MAX_TOKENS), (3, 5), (10, 13), (11, 2)]:
        sent = random_tensors(num_tokens, dtype, seed=step_id)
        notice = sender.write(step_id, sent)
        assert notice == ActivationNotice(step_id, step_id % NUM_SLOTS, num_tokens, list(INTERMEDIATE_KEYS))
        got = receiver.view(notice)
        assert got.keys() == tuple(INTERMEDIATE_KEYS)
        for key in INTERMEDIATE_KEYS:
            assert got[key].dtype == dtype
            assert got[key].shape == (num_tokens, HIDDEN)
            assert torch.equal(got[key], sent[key])


def test_view_is_zero_copy_into_the_slot(ring):
    receiver, sender = ring
    notice = sender.write(4, random_tensors(3, torch.float32, seed=1))
    view = receiver.view(notice)
    # The view aliases the slot: the sender's next write into the same slot shows through it.
    sender.write(4 + NUM_SLOTS, random_tensors(3, torch.float32, seed=2))
    assert torch.equal(view["residual"], random_tensors(3, torch.float32, seed=2)["residual"])
    # Slots do not overlap: a write into another slot leaves this one alone.
    before = view["hidden_states"].clone()
    sender.write(5, random_tensors(MAX_TOKENS, torch.float32, seed=3))
    assert torch.equal(view["hidden_states"], before)


def test_sender_in_a_separate_mapping_sees_the_same_memory(ring):
    receiver, _ = ring
    second = get_transport("shm").attach_sender(receiver.spec)
    try:
        sent = random_tensors(6, torch.float32, seed=9)
        got = receiver.view(second.write(8, sent))
        assert torch.equal(got["hidden_states"], sent["hidden_states"])
    finally:
        second.close()


def notice(**overrides) -> ActivationNotice:
    values = dict(step_id=7, slot=1, num_tokens=4, keys=list(INTERMEDIATE_KEYS))
    values.update(overrides)
    return ActivationNotice(**values)


BAD_NOTICES = [
    (notice(keys=["hidden_states"]), r"step 7: activation keys \['hidden_states'\] differ from the agreed"),
    (notice(keys=["residual", "hidden_states"]), "differ from the agreed"),
    (notice(keys=[*INTERMEDIATE_KEYS, "aux"]), "differ from the agreed"),
    (notice(keys=[]), "differ from the agreed"),
    (notice(num_tokens=MAX_TOKENS + 1), f"step 7: {MAX_TOKENS + 1} tokens do not fit the ring's {MAX_TOKENS}-token slots"),
    (notice(num_tokens=0), "step 7: 0 tokens do not fit"),
    (notice(num_tokens=-3), "step 7: -3 tokens do not fit"),
    (notice(slot=NUM_SLOTS), f"step 7: slot {NUM_SLOTS} outside the ring's {NUM_SLOTS} slots"),
    (notice(slot=-1), f"step 7: slot -1 outside the ring's {NUM_SLOTS} slots"),
]


@pytest.mark.parametrize("bad,words", BAD_NOTICES)
def test_receiver_rejects_a_mismatched_notice(ring, bad, words):
    receiver, _ = ring
    with pytest.raises(ActivationError, match=words):
        receiver.view(bad)


def test_sender_refuses_what_the_receiver_would_reject(ring):
    _, sender = ring
    with pytest.raises(ActivationError, match="do not fit"):
        sender.write(1, random_tensors(MAX_TOKENS + 1, torch.float32, seed=0))
    with pytest.raises(ActivationError, match="differ from the agreed"):
        sender.write(1, IntermediateTensors({"hidden_states": torch.zeros(2, HIDDEN)}))
    with pytest.raises(ActivationError, match="0 tokens do not fit"):
        sender.write(1, random_tensors(0, torch.float32, seed=0))


def test_close_and_unlink_leave_nothing_in_dev_shm():
    spec = make_spec("bfloat16")
    path = Path(f"/dev/shm/{spec.name}")
    receiver = ShmReceiver(spec)
    sender = ShmSender(spec)
    assert path.exists()
    sender.close()
    assert path.exists()  # the sender only unmaps; the receiver owns the segment
    receiver.close()
    assert not path.exists()
    with pytest.raises(FileNotFoundError):
        ShmSender(spec)  # a sender cannot attach to a ring that is gone


def test_receiver_refuses_a_name_already_in_use():
    spec = make_spec()
    receiver = ShmReceiver(spec)
    try:
        with pytest.raises(FileExistsError):
            ShmReceiver(spec)
    finally:
        receiver.close()
    assert not Path(f"/dev/shm/{spec.name}").exists()
