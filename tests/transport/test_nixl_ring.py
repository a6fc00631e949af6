"""The nixl activation ring in one process over TCP: written slots read back exactly, mismatches fail the step."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("nixl_cu12")

from asyncpp.model.intermediate import IntermediateTensors  # noqa: E402
from asyncpp.transport import ActivationError, ActivationNotice, RingSpec, get_transport  # noqa: E402
from asyncpp.transport import nixl as nixl_ring  # noqa: E402

KEYS = ["hidden_states", "residual"]


@pytest.fixture
def ring(monkeypatch):
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))
    spec = RingSpec("nixl", f"asyncpp-test-{os.getpid()}-ring1", KEYS, 3, 32, 16, "float32")
    receiver = get_transport("nixl").create_receiver(spec)
    sender = get_transport("nixl").attach_sender(receiver.spec)
    yield receiver, sender
    sender.close()
    receiver.close()


def _tensors(num_tokens: int, seed: int) -> IntermediateTensors:
    g = torch.Generator().manual_seed(seed)
    return IntermediateTensors({k: torch.randn(num_tokens, 16, generator=g) for k in KEYS})


def test_writes_land_in_the_receivers_slot(ring):
    receiver, sender = ring
    for step_id, num_tokens in enumerate([5, 32, 1, 7]):  # slots reused: 4 steps on 3 slots
        sent = _tensors(num_tokens, step_id)
        notice = sender.write(step_id, sent)
        assert notice.slot == step_id % 3 and notice.num_tokens == num_tokens
        got = receiver.view(notice)
        for key in KEYS:
            assert torch.equal(got[key], sent[key])


def test_a_bad_notice_or_size_fails_that_step_only(ring, monkeypatch):
    receiver, sender = ring
    with pytest.raises(ActivationError, match="do not fit"):
        sender.write(0, _tensors(33, 0))
    with pytest.raises(ActivationError, match="keys"):
        receiver.view(ActivationNotice(0, 0, 0, []))  # what a failing sender sends
    monkeypatch.setattr(nixl_ring, "NOTIF_TIMEOUT_S", 0.2)
    with pytest.raises(ActivationError, match="did not arrive"):
        receiver.view(ActivationNotice(9, 0, 4, KEYS))  # a notice whose write never came
    sent = _tensors(4, 1)
    assert torch.equal(receiver.view(sender.write(1, sent))["residual"], sent["residual"])
