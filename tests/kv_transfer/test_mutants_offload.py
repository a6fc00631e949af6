"""The offload index and stores at their edges: a bad entry does not stop the ones after it, a payload
of the wrong dtype or layout is refused, a directory store's stray files are not records. Written for
mutation-test survivors in `kv_transfer/offload/` (index, store, scheduler)."""

from __future__ import annotations

import types
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


def test_forget_transfers_unpins_loads_frees_unsaved_slots_and_keeps_the_sealed_ones():
    from asyncpp.kv_transfer.base import PlanInfo
    from tests.core.sched_helpers import make_request

    ctx = ConnectorContext(
        name="offload", pp_size=2, layer_ranges=((0, 1), (1, 4)), block_size=16, num_kv_heads=2, head_dim=8,
        dtype="float32", model_id="test", run_id="t", store="shm", store_size_mb=1,
    )  # fmt: skip
    scheduler = OffloadScheduler(ctx)
    assert scheduler.can_forget_transfers
    loading = make_request("loading", list(range(1, 50)))  # 3 full blocks before its last token
    sealed = scheduler._hashes_of(loading)
    scheduler.index.prepare_store(sealed)
    scheduler.index.complete_store(sealed)
    assert scheduler.get_num_new_matched_tokens(loading, 0) == (48, True)
    scheduler.update_state_after_alloc(loading, [10, 11, 12, 13], 48)
    other = make_request("other", list(range(1, 40)))  # the same first block: asked again later, meanwhile
    assert scheduler.get_num_new_matched_tokens(other, 0) == (None, False)
    saving, one = make_request("saving", list(range(100, 140))), make_request("one", list(range(200, 217)))
    plan = PlanInfo(
        1, [(saving, 0, 40), (one, 0, 17)], {"saving": [20, 21, 22], "one": [30, 31]},
        {"saving": [H[5], H[6]], "one": [H[7]]},
    )  # fmt: skip
    assert len(scheduler.build_connector_meta(plan).saves) == 2
    assert (scheduler.index.num_pinned, scheduler.index.num_pending, scheduler.index.num_ready) == (3, 3, 3)

    logged = []
    scheduler.log = types.SimpleNamespace(info=lambda event, **fields: logged.append((event, fields)))
    scheduler.forget_transfers()

    assert logged == [("kv_store_transfers_forgotten", {"num_loads": 1, "num_unsaved_blocks": 3, "num_ready_blocks": 3})]
    assert (scheduler.index.num_pinned, scheduler.index.num_pending, scheduler.index.num_ready) == (0, 0, 3)
    assert not scheduler.has_unsent_metadata() and scheduler.request_finished(saving, []) == (False, None)
    assert scheduler.get_num_new_matched_tokens(other, 0) == (32, True)  # no load in flight any more
    assert scheduler.index.num_free_slots == scheduler.index.num_slots - 3  # the unsaved slots are free
    meta = scheduler.build_connector_meta(plan)  # computed again from its first token: saved again
    assert [t.block_hashes for t in meta.saves] == [[H[5], H[6]], [H[7]]] and meta.loads == []


def test_a_restarted_stage_adopts_the_store_its_killed_predecessor_left():
    lay = layout()
    name = f"asyncpp-test-kvstore-{uuid.uuid4().hex[:8]}"
    fresh = ShmBlockStore.create_or_adopt(name, lay)  # none there: made
    payload = torch.randn(lay.payload_shape)
    fresh.write(1, H[1], payload)
    fresh.close()  # killed: closed, never unlinked
    adopted = ShmBlockStore.create_or_adopt(name, lay)
    out = torch.empty_like(payload)
    assert adopted.read_into(1, H[1], out) is None and torch.equal(out, payload)
    adopted.close()
    adopted.unlink()  # its owner now: removes it
    assert shm_segments(name) == []
    ShmBlockStore(name, layout(num_slots=2), create=True).close()
    try:
        with pytest.raises(ValueError, match="holds"):
            ShmBlockStore.create_or_adopt(name, lay)  # too small for this layout: refused, not overrun
    finally:  # the refused attach left it unregistered here: removed as by a stranger
        leftover = ShmBlockStore(name, layout(num_slots=2), create=False)
        leftover.close()
        leftover.unlink()
    assert shm_segments(name) == []
