"""The offload index and stores at their edges: a bad entry does not stop the ones after it, a payload
of the wrong dtype or layout is refused, a directory store's stray files are not records. Written for
mutation-test survivors in `kv_transfer/offload/` (index, store, scheduler)."""

from __future__ import annotations

import uuid

import pytest
import torch

from asyncpp.kv_transfer.base import ConnectorContext
from asyncpp.kv_transfer.offload.index import OffloadIndex
from asyncpp.kv_transfer.offload.layout import shm_name
from asyncpp.kv_transfer.offload.scheduler import OffloadScheduler
from asyncpp.kv_transfer.offload.store import (
    DirBlockStore,
    ShmBlockStore,
    StoreLayout,
    store_fingerprint,
)
from tests.runtime.harness import shm_segments

H = [bytes([i]) * 32 for i in range(8)]


def layout(num_slots: int = 4) -> StoreLayout:
    return StoreLayout(num_slots, 3, 4, 2, 8, "float32", store_fingerprint("m", 0, 3, "float32", 4, 2, 8))


def test_unpin_skips_unknown_and_unpinned_hashes_and_still_unpins_the_rest():
    index = OffloadIndex(3)
    index.prepare_store(H[:2])
    index.complete_store(H[:2])
    index.pin([H[1]])
    index.unpin([H[5], H[0], H[1]])  # H[5] is unknown, H[0] is not pinned
    assert index.num_pinned == 0
    index.discard([H[1]])
    assert index.slot_of(H[1]) is None  # unpinned, so the discard frees its slot at once


def test_an_index_of_one_slot_is_allowed():
    index = OffloadIndex(1)
    assert index.prepare_store([H[0]]) == [(H[0], 0)]
    with pytest.raises(ValueError, match="num_slots"):
        OffloadIndex(0)


def test_index_restore_skips_a_bad_entry_and_keeps_the_ones_after_it():
    index = OffloadIndex(3)
    index.restore([(5, H[5]), (0, H[0]), (1, H[0]), (2, H[2])])  # out of range, then a duplicate hash
    assert (index.slot_of(H[0]), index.slot_of(H[2]), index.num_ready, index.num_free_slots) == (0, 2, 2, 1)


def test_a_payload_of_another_dtype_is_refused(make_store):
    lay = layout()
    store = make_store(lay)
    with pytest.raises(ValueError, match="expected"):
        store.write(0, H[0], torch.zeros(lay.payload_shape, dtype=torch.int32))  # same size, other dtype
    assert store.scan() == {}


def test_a_non_contiguous_out_is_refused_not_silently_left_unfilled(make_store):
    lay = layout()
    store = make_store(lay)
    payload = torch.randn(lay.payload_shape)
    store.write(0, H[0], payload)
    # Rows of a bigger tensor: the shape and dtype fit, but a flat view of it would be a copy.
    out = torch.zeros((2 * lay.payload_shape[0], *lay.payload_shape[1:]))[::2]
    assert tuple(out.shape) == lay.payload_shape and not out.is_contiguous()
    with pytest.raises(ValueError, match="contiguous"):
        store.read_into(0, H[0], out)


def test_directory_scan_ignores_truncated_files_and_slots_past_the_layout(tmp_path):
    big, small = layout(num_slots=8), layout(num_slots=4)
    store = DirBlockStore(tmp_path, big)
    payload = torch.randn(big.payload_shape)
    for slot in (1, 2, 6):
        store.write(slot, H[slot], payload)
    store.path(2).write_bytes(store.path(2).read_bytes()[:10])  # cut inside its header
    assert DirBlockStore(tmp_path, big).scan() == {1: H[1], 6: H[6]}
    assert DirBlockStore(tmp_path, small).scan() == {1: H[1]}  # the store shrank: slot 6 is not one of it


def test_the_scheduler_removes_the_shm_stores_its_stages_left_behind():
    run_id = f"t{uuid.uuid4().hex[:8]}"
    ctx = ConnectorContext(
        name="offload", pp_size=2, layer_ranges=((0, 1), (1, 4)), block_size=16, num_kv_heads=2, head_dim=8,
        dtype="float32", model_id="test", run_id=run_id, store="shm", store_size_mb=1,
    )  # fmt: skip
    scheduler = OffloadScheduler(ctx)
    for rank, lay in enumerate(scheduler.layouts):  # as a killed stage leaves them: closed, not unlinked
        ShmBlockStore(shm_name(ctx, rank), lay, create=True).close()
    assert len(shm_segments(f"asyncpp-{run_id}-")) == 2
    scheduler.close()
    assert shm_segments(f"asyncpp-{run_id}-") == []
