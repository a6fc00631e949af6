"""Shared KV caches of shift windows: one buffer seen by both neighbouring stages, unlinked by its creator."""

from __future__ import annotations

import multiprocessing
import uuid

import pytest
import torch

from asyncpp.worker.shared_kv import SharedKVSegment, SharedKVSpec, allocate_shared_kv, shared_kv_specs


def _spec(dtype: str = "bfloat16") -> SharedKVSpec:
    return SharedKVSpec(f"asyncpp-test-{uuid.uuid4().hex[:8]}-kv0", first_layer=14, num_layers=3, num_slots=32,
                        num_kv_heads=3, head_dim=8, dtype=dtype)  # fmt: skip


def _write_in_child(spec: SharedKVSpec) -> None:
    segment = SharedKVSegment.attach(spec)
    segment.caches()[15][1][5].fill_(2.5)  # layer 15's V, slot 5
    segment.close()


def test_a_layer_written_in_one_process_is_read_in_the_other():
    spec = _spec()
    owner = SharedKVSegment.create(spec)
    try:
        caches = owner.caches()
        assert sorted(caches) == [14, 15, 16]
        k, v = caches[15]
        assert k.shape == (32, 3, 8) and k.dtype == torch.bfloat16 and k.is_contiguous() and v.is_contiguous()
        assert not torch.any(k) and not torch.any(v)  # fresh memory reads as zeros
        child = multiprocessing.get_context("spawn").Process(target=_write_in_child, args=(spec,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert torch.all(v[5] == 2.5) and not torch.any(v[4]) and not torch.any(caches[14][1])
    finally:
        owner.close()
    with pytest.raises(FileNotFoundError):
        SharedKVSegment.attach(spec)


def test_specs_only_for_windows_with_layers():
    specs = shared_kv_specs([(14, 22), (25, 25)], ["a", "b"], 160, 3, 64, "float32")
    assert specs == [SharedKVSpec("a", 14, 8, 160, 3, 64, "float32")]
    assert specs[0].nbytes == 2 * 8 * 160 * 3 * 64 * 4
    caches = allocate_shared_kv(specs)
    assert sorted(caches) == list(range(14, 22)) and caches[21][0].shape == (160, 3, 64)
