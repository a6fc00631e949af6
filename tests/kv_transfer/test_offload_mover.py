"""The offload `BlockMover` on a CPU cache: bit-exact round trips through both stores, damaged
records come back as misses of their block only, and the cache guard brackets every cache access
(a cancelled job stops, leaving misses, never a mix of old and new bytes)."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
import torch

from asyncpp.kv_transfer.offload.mover import BlockMover, TransferCancelled
from asyncpp.kv_transfer.offload.store import (
    DirBlockStore, HEADER_NBYTES, ShmBlockStore, StoreLayout, store_fingerprint,
)
from tests.runtime.harness import shm_segments

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS = 3, 4, 2, 8, 12
H = [bytes([i + 1]) * 32 for i in range(8)]
SRC = [9, 2, 7, 0, 11]  # unsorted, with gaps
SLOTS = [5, 1, 7, 0, 3]
DST = [3, 10, 1, 6, 8]


def layout(dtype: str) -> StoreLayout:
    return StoreLayout(8, LAYERS, BLOCK, HEADS, DIM, dtype, store_fingerprint("m", 0, LAYERS, dtype, BLOCK, HEADS, DIM))


def caches(dtype: torch.dtype, fill: str = "randn", seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS * BLOCK, HEADS, DIM)
    make = (lambda: torch.randn(shape, generator=g).to(dtype)) if fill == "randn" else (lambda: torch.zeros(shape, dtype=dtype))
    return [(make(), make()) for _ in range(LAYERS)]


def block(kv_caches, b: int) -> list[torch.Tensor]:
    """Block b over every layer, K and V, as raw bits."""
    rows = slice(b * BLOCK, (b + 1) * BLOCK)
    return [cache[rows].view(torch.uint8) for pair in kv_caches for cache in pair]


def same_block(a, b_a: int, b, b_b: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(block(a, b_a), block(b, b_b)))


@pytest.fixture(params=["shm", "dir"])
def make_store(request, tmp_path):
    made = []

    def make(lay: StoreLayout):
        if request.param == "shm":
            store = ShmBlockStore(f"asyncpp-test-kvmover-{os.getpid()}-{uuid.uuid4().hex[:8]}", lay, create=True)
        else:
            store = DirBlockStore(tmp_path / uuid.uuid4().hex[:8], lay)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
        if isinstance(store, ShmBlockStore):
            store.unlink()
    assert not [n for n in shm_segments("asyncpp-test-kvmover-") if str(os.getpid()) in n]


class Guard:
    """A stand-in for the worker's cache guard: counts entries; cancels from entry `cancel_at`
    on (raising on entry), or raises on leaving the entry `cancel_on_exit`."""

    def __init__(self, cancel_at: int | None = None, cancel_on_exit: int | None = None) -> None:
        self.entries = 0
        self.inside = False
        self.cancel_at, self.cancel_on_exit = cancel_at, cancel_on_exit

    @contextlib.contextmanager
    def __call__(self):
        self.entries += 1
        if self.cancel_at is not None and self.entries >= self.cancel_at:
            raise TransferCancelled("job timed out")
        self.inside = True
        try:
            yield
        finally:
            self.inside = False
        if self.entries == self.cancel_on_exit:
            raise TransferCancelled("job timed out while copying")


def test_saved_blocks_load_back_bit_exact_anywhere(make_store):
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        for chunk_nbytes in (16 << 20, 2 * layout(name).payload_nbytes):  # one chunk, and chunks of 2 blocks
            store = make_store(layout(name))
            src, dst = caches(dtype), caches(dtype, "zeros")
            guard = Guard()
            saved = BlockMover(src, BLOCK, store, chunk_nbytes).save(SRC, H[:5], SLOTS, guard)
            assert saved == 5 * store.layout.payload_nbytes
            assert BlockMover(dst, BLOCK, store, chunk_nbytes).load(DST, H[:5], SLOTS, guard) == {}
            assert all(same_block(src, s, dst, d) for s, d in zip(SRC, DST))
            untouched = set(range(NUM_BLOCKS)) - set(DST)
            assert all(not x.any() for b in untouched for x in block(dst, b))
            assert guard.entries == (2 if chunk_nbytes == 16 << 20 else 6)


def test_records_are_the_stores_format(make_store):
    """What the mover saves, `read_into` reads, and what `write` stored, the mover loads."""
    store = make_store(layout("float32"))
    src, dst = caches(torch.float32), caches(torch.float32, "zeros")
    mover = BlockMover(src, BLOCK, store)
    mover.save([4], [H[0]], [2], Guard())
    out = torch.empty(store.layout.payload_shape)
    assert store.read_into(2, H[0], out) is None
    assert torch.equal(out[1, 1], src[1][1][4 * BLOCK : 5 * BLOCK])
    store.write(6, H[1], out * 2)
    assert BlockMover(dst, BLOCK, store).load([0], [H[1]], [6], Guard()) == {}
    assert torch.equal(dst[2][0][:BLOCK], 2 * src[2][0][4 * BLOCK : 5 * BLOCK])


def damage(store, slot: int, how: str) -> None:
    if isinstance(store, ShmBlockStore):
        record = store._records[slot]
        if how == "flip":
            record[HEADER_NBYTES + 100] ^= 1
        elif how == "truncate":  # a segment cannot be cut short: a record never finished reads alike
            record[:HEADER_NBYTES] = 0
        return
    path = store.path(slot)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[HEADER_NBYTES + 100] ^= 1
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[:-5]))


@pytest.mark.parametrize("chunk_blocks", [16, 2])
def test_damaged_records_are_misses_of_their_block_only(make_store, chunk_blocks):
    store = make_store(layout("bfloat16"))
    src, dst = caches(torch.bfloat16), caches(torch.bfloat16, "zeros")
    BlockMover(src, BLOCK, store).save(SRC, H[:5], SLOTS, Guard())
    damage(store, SLOTS[1], "flip")
    damage(store, SLOTS[3], "truncate")
    hashes = list(H[:5])
    hashes[4] = H[7]  # the slot holds another block
    mover = BlockMover(dst, BLOCK, store, chunk_blocks * store.layout.payload_nbytes)
    failed = mover.load(DST, hashes, SLOTS, Guard())
    truncated = "missing" if isinstance(store, ShmBlockStore) else "truncated"
    assert failed == {1: "checksum mismatch", 3: truncated, 4: "hash mismatch"}
    for i in (0, 2):
        assert same_block(src, SRC[i], dst, DST[i])
    for i in (1, 3, 4):  # never a damaged record's bytes
        assert all(not x.any() for x in block(dst, DST[i]))


def test_another_layout_is_refused_and_its_records_are_misses(make_store):
    store = make_store(layout("float32"))
    with pytest.raises(ValueError, match="bfloat16"):
        BlockMover(caches(torch.bfloat16), BLOCK, store)
    with pytest.raises(ValueError, match="layers"):
        BlockMover(caches(torch.float32)[:2], BLOCK, store)
    with pytest.raises(ValueError, match="block size"):
        BlockMover(caches(torch.float32), 2, store)
    mover = BlockMover(caches(torch.float32), BLOCK, store)
    with pytest.raises(ValueError, match="outside"):
        mover.save([NUM_BLOCKS], [H[0]], [0], Guard())
    with pytest.raises(ValueError, match="outside"):
        mover.load([0], [H[0]], [8], Guard())


def test_a_cache_on_another_device_is_refused_naming_it(make_store):
    store = make_store(layout("float32"))
    meta = [tuple(torch.empty(NUM_BLOCKS * BLOCK, HEADS, DIM, device="meta") for _ in range(2)) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="device meta"):
        BlockMover(meta, BLOCK, store)


def test_a_load_writes_the_cache_only_inside_the_guard(make_store):
    store = make_store(layout("float32"))
    src, dst = caches(torch.float32), caches(torch.float32, "zeros")
    BlockMover(src, BLOCK, store).save(SRC, H[:5], SLOTS, Guard())
    mover = BlockMover(dst, BLOCK, store, 2 * store.layout.payload_nbytes)
    with pytest.raises(TransferCancelled):
        mover.load(DST, H[:5], SLOTS, Guard(cancel_at=1))
    assert not any(x.any() for pair in dst for x in pair)
    with pytest.raises(TransferCancelled):
        mover.load(DST, H[:5], SLOTS, Guard(cancel_at=2))  # the first chunk (2 blocks) went in
    assert same_block(src, SRC[0], dst, DST[0]) and same_block(src, SRC[1], dst, DST[1])
    assert all(not x.any() for i in (2, 3, 4) for x in block(dst, DST[i]))


def test_a_cancelled_save_leaves_misses_never_old_or_mixed_records(make_store):
    store = make_store(layout("float32"))
    old, new = caches(torch.float32, seed=1), caches(torch.float32, seed=2)
    BlockMover(old, BLOCK, store).save(SRC, H[:5], SLOTS, Guard())
    mover = BlockMover(new, BLOCK, store, 2 * store.layout.payload_nbytes)
    new_hashes = H[3:8]
    with pytest.raises(TransferCancelled):
        mover.save(SRC, new_hashes, SLOTS, Guard(cancel_at=2))  # the first chunk is stored
    dst = caches(torch.float32, "zeros")
    failed = BlockMover(dst, BLOCK, store).load(DST, new_hashes, SLOTS, Guard())
    if isinstance(store, ShmBlockStore):  # the stopped chunk's headers were zeroed before its copy
        assert failed == {2: "missing", 3: "missing", 4: "hash mismatch"}  # 4: a chunk never begun
    else:  # files are replaced whole, after the guard: the stopped chunk's slots keep the old records
        assert failed == {2: "hash mismatch", 3: "hash mismatch", 4: "hash mismatch"}
    assert same_block(new, SRC[0], dst, DST[0]) and same_block(new, SRC[1], dst, DST[1])


def test_a_shm_record_copied_but_not_sealed_is_a_miss():
    """Cancelled while the copy ran (the guard raises on leaving): the payload holds the new bytes, its
    header is still zero, so the record is missing rather than an old header over new bytes."""
    lay = layout("float32")
    store = ShmBlockStore(f"asyncpp-test-kvmover-{os.getpid()}-{uuid.uuid4().hex[:8]}", lay, create=True)
    try:
        old, new = caches(torch.float32, seed=1), caches(torch.float32, seed=2)
        BlockMover(old, BLOCK, store).save([5], [H[0]], [3], Guard())
        with pytest.raises(TransferCancelled):
            BlockMover(new, BLOCK, store).save([5], [H[0]], [3], Guard(cancel_on_exit=1))
        payload = torch.empty(lay.payload_shape)
        payload.view(-1).view(torch.uint8).numpy()[:] = store.payload_records()[3]
        assert torch.equal(payload[0, 0], new[0][0][5 * BLOCK : 6 * BLOCK])  # the copy happened
        assert store.read_into(3, H[0], payload) == "missing"
        assert BlockMover(caches(torch.float32, "zeros"), BLOCK, store).load([0], [H[0]], [3], Guard()) == {0: "missing"}
        assert store.scan() == {}
    finally:
        store.close()
        store.unlink()
