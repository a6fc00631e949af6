"""The offload store's records (shm and directory) and the engine's slot index."""

from __future__ import annotations

import os
import random
import uuid

import pytest
import torch

from asyncpp.kv_transfer.offload.blocks import gather_blocks, scatter_blocks
from asyncpp.kv_transfer.offload.index import OffloadIndex
from asyncpp.kv_transfer.offload.store import DirBlockStore, ShmBlockStore, StoreLayout, store_fingerprint
from tests.runtime.harness import shm_segments

H = [bytes([i]) * 32 for i in range(8)]


def layout(dtype: str = "float32", model: str = "m", num_slots: int = 4) -> StoreLayout:
    return StoreLayout(num_slots, 3, 4, 2, 8, dtype, store_fingerprint(model, 0, 3, dtype, 4, 2, 8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact_and_checked(make_store, dtype):
    lay = layout(dtype)
    store = make_store(lay)
    payload = torch.randn(lay.payload_shape).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    out = torch.empty_like(payload)
    assert store.read_into(1, H[1], out) == "missing"
    store.write(1, H[1], payload)
    assert store.read_into(1, H[1], out) is None and torch.equal(out, payload)
    store.write(1, H[2], payload * 2)  # the slot now holds another block
    assert store.read_into(1, H[1], out) == "hash mismatch"
    assert store.scan() == {1: H[2]}


def test_another_layout_is_a_fingerprint_mismatch(make_store):
    store = make_store(layout(model="m1"), "x")
    store.write(0, H[0], torch.zeros(layout().payload_shape))
    if isinstance(store, ShmBlockStore):
        other = ShmBlockStore(store.name, layout(model="m2"), create=False)
    else:
        other = DirBlockStore(store.directory, layout(model="m2"))
    assert other.read_into(0, H[0], torch.empty(layout().payload_shape)) == "fingerprint mismatch"
    assert other.scan() == {}
    other.close()


def test_directory_store_damage_is_a_miss_and_survives_restart(tmp_path):
    lay = layout()
    store = DirBlockStore(tmp_path, lay)
    payload = torch.randn(lay.payload_shape)
    for slot in range(3):
        store.write(slot, H[slot], payload)
    out = torch.empty_like(payload)
    data = bytearray(store.path(0).read_bytes())
    data[-1] ^= 1
    store.path(0).write_bytes(bytes(data))
    store.path(1).write_bytes(store.path(1).read_bytes()[:-7])
    store.path(2).write_bytes(b"junk" + store.path(2).read_bytes()[4:])
    restarted = DirBlockStore(tmp_path, lay)
    assert restarted.read_into(0, H[0], out) == "checksum mismatch"
    assert restarted.read_into(1, H[1], out) == "truncated"
    assert restarted.read_into(2, H[2], out) == "bad magic"
    restarted.write(3, H[3], payload)
    assert DirBlockStore(tmp_path, lay).read_into(3, H[3], out) is None and torch.equal(out, payload)


def test_unwritable_directory_fails_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=str(blocker)):
        DirBlockStore(blocker / "store", layout())


def test_attached_shm_store_sees_the_writes():
    name = f"asyncpp-test-kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    owner = ShmBlockStore(name, layout(), create=True)
    reader = ShmBlockStore(name, layout(), create=False)
    payload = torch.randn(layout().payload_shape)
    owner.write(2, H[2], payload)
    out = torch.empty_like(payload)
    assert reader.read_into(2, H[2], out) is None and torch.equal(out, payload)
    reader.close()
    owner.close()
    owner.unlink()
    assert name not in shm_segments("asyncpp-test-kvstore-")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_scatter_blocks_round_trip(dtype):
    caches = [(torch.randn(10 * 4, 2, 8).to(dtype), torch.randn(10 * 4, 2, 8).to(dtype)) for _ in range(3)]
    payload = gather_blocks(caches, [7, 2], 4)
    assert payload.shape == (2, 3, 2, 4, 2, 8)
    assert torch.equal(payload[0, 1, 1], caches[1][1][28:32])
    fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    scatter_blocks(fresh, [7, 2], 4, payload)
    assert torch.equal(fresh[2][0][8:12], caches[2][0][8:12]) and torch.equal(fresh[0][1][28:32], caches[0][1][28:32])
    assert not fresh[0][0][:8].any()  # other blocks untouched
    with pytest.raises(ValueError):
        scatter_blocks(fresh, [1], 4, payload)


def test_index_evicts_lru_ready_never_pending_or_pinned():
    index = OffloadIndex(3)
    assert [slot for _, slot in index.prepare_store(H[:3])] == [0, 1, 2]
    assert index.prepare_store([H[3]]) == []  # all PENDING
    index.complete_store(H[:3])
    assert index.lookup(H[:4]) == 3
    index.pin([H[0]])  # H[0] becomes most recently used, and pinned
    placed = index.prepare_store([H[3], H[4], H[5]])
    assert placed == [(H[3], 1), (H[4], 2)]  # H[1], then H[2] evicted; H[0] is pinned
    assert index.slot_of(H[1]) is None and index.lookup([H[0]]) == 1
    index.discard([H[0]])
    assert index.slot_of(H[0]) == 0  # leaves on its last unpin
    index.unpin([H[0]])
    assert index.slot_of(H[0]) is None and index.num_free_slots == 1
    index.complete_store([H[3]], success=False)
    assert index.num_free_slots == 2 and index.num_pending == 1


def test_index_invariants_under_random_operations():
    rng = random.Random(0)
    index = OffloadIndex(8)
    hashes = [bytes([i]) * 32 for i in range(20)]
    pinned: list[bytes] = []
    for _ in range(2000):
        op = rng.randrange(5)
        batch = rng.sample(hashes, 3)
        if op == 0:
            index.prepare_store(batch)
        elif op == 1:
            index.complete_store(batch, success=rng.random() < 0.8)
        elif op == 2:
            ready = [h for h in batch if index.is_ready(h)]
            index.pin(ready)
            pinned += ready
        elif op == 3 and pinned:
            index.unpin([pinned.pop(rng.randrange(len(pinned)))])
        else:
            index.discard(batch[:1])
        slots = [e.slot for e in index._entries.values()]
        assert len(slots) == len(set(slots)) and not set(slots) & set(index._free_slots)
        assert index.num_free_slots + len(slots) == 8
        for h in set(pinned):
            assert index.slot_of(h) is not None  # a pinned block is never evicted


def test_index_restore_keeps_order_and_skips_bad_slots():
    index = OffloadIndex(3)
    index.restore([(2, H[2]), (0, H[0]), (5, H[5]), (1, H[0])])
    assert index.num_ready == 2 and index.num_free_slots == 1
    assert index.prepare_store([H[6], H[7]]) == [(H[6], 1), (H[7], 2)]  # the free slot, then the oldest


def test_a_prefaulted_shm_store_takes_writes_without_page_faults():
    import resource

    def minor_faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    lay = layout("bfloat16", num_slots=256)
    store = ShmBlockStore(f"asyncpp-test-kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}", lay, create=True)
    try:
        payload = torch.ones(lay.payload_shape, dtype=torch.bfloat16)
        before = minor_faults()
        store.write(0, H[0], payload)  # a fresh page: faults
        assert minor_faults() - before >= lay.payload_nbytes // 4096 // 2
        store.prefault()
        before = minor_faults()
        for slot in range(1, 4):
            store.write(slot, H[slot], payload)
        assert minor_faults() - before < 8  # mapped already (a few for numpy's own temporaries)
        assert store.read_into(0, H[0], torch.empty_like(payload)) is None  # prefaulting kept the record
    finally:
        store.close()
        store.unlink()
