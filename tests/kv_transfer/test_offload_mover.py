"""The offload `BlockMover` on a CPU cache: bit-exact round trips through both stores, damaged
records come back as misses of their block only, and the cache guard brackets every cache access
(a cancelled job stops, leaving misses, never a mix of old and new bytes). Its in-place shm path,
step by step, with the `kv_records` kernel at every ISA level and without it (numpy and crc32c):
the same records and verdicts whichever level wrote or reads them."""

from __future__ import annotations

import contextlib
import os
import uuid

import crc32c
import numpy as np
import pytest
import torch

from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.kv_records import kv_record_kernel
from asyncpp.kv_transfer.offload.copier import HostCopier
from asyncpp.kv_transfer.offload.mover import BlockMover, TransferCancelled
from asyncpp.kv_transfer.offload.store import (
    HEADER_NBYTES, ShmBlockStore, StoreLayout, store_fingerprint,
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


# ---- the in-place shm path, step by step, per ISA level ----------------------------------------
# None: no kernel (numpy copies, crc32c checksums); generic: kernel copies, crc32c checksums (no SSE4.2).
LEVELS = [None] + [level for level in cpu_info().supported_levels if level != "amx"]


@pytest.fixture
def shm_pair():
    """make(save_isa, load_isa): two stores on one new segment, each with its own kernel level."""
    made = []

    def make(save_isa, load_isa, lay=None):
        if kv_record_kernel("generic") is None and (save_isa or load_isa):
            pytest.skip("no C compiler: kv_records kernel unavailable")
        lay = lay or layout("bfloat16")
        name = f"asyncpp-test-kvmover-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        writer = ShmBlockStore(name, lay, create=True, isa=save_isa)
        made.append(writer)
        reader = ShmBlockStore(name, lay, create=False, isa=load_isa)
        made.append(reader)
        return writer, reader

    yield make
    for store in made:
        store.close()
    for reader in made[1::2]:  # the reader's unlink, not the owner's: its attach took the owner's tracker entry
        reader.unlink()
    assert not [n for n in shm_segments("asyncpp-test-kvmover-") if str(os.getpid()) in n]


def save_in_place(copier: HostCopier, store: ShmBlockStore, block_ids, hashes, slots) -> None:
    """What the mover does for a chunk: headers zeroed, pieces copied (and checksums noted), headers written."""
    store.begin_write(slots)
    copier.gather_into(np.asarray(block_ids), store.payload_records(), np.asarray(slots))
    store.seal(slots, hashes)


@pytest.mark.parametrize("save_isa", LEVELS)
@pytest.mark.parametrize("load_isa", LEVELS)
def test_in_place_records_and_verdicts_are_the_same_at_every_level(shm_pair, save_isa, load_isa):
    writer, reader = shm_pair(save_isa, load_isa)
    lay = writer.layout
    src, dst = caches(torch.bfloat16), caches(torch.bfloat16, "zeros")
    save_in_place(HostCopier(src, lay, 4, isa=save_isa), writer, SRC, H[:5], SLOTS)
    for slot, block_id in zip(SLOTS, SRC):  # the format's CRC32C, whoever computed it
        header = reader.check_headers([slot], [H[SRC.index(block_id)]])
        assert header[0] == [None] and int(header[1][0]) == crc32c.crc32c(reader.payload_records()[slot].tobytes())
    damage(reader, SLOTS[1], "flip")
    hashes = list(H[:5])
    hashes[4] = H[7]
    reasons = reader.verify(SLOTS, hashes)
    assert reasons == [None, "checksum mismatch", None, None, "hash mismatch"]
    good = [i for i, reason in enumerate(reasons) if reason is None]
    copier = HostCopier(dst, lay, 4, isa=load_isa)
    copier.scatter_from(np.array([DST[i] for i in good]), reader.payload_records(), np.array([SLOTS[i] for i in good]))
    for i in range(5):
        assert same_block(src, SRC[i], dst, DST[i]) if i in good else all(not x.any() for x in block(dst, DST[i]))


@pytest.mark.parametrize("isa", LEVELS)
def test_a_scatter_checked_against_the_headers_copies_intact_records_only(shm_pair, isa):
    """check_headers gives the CRC32C each payload must have without reading it; scatter_from with them
    checks each record before copying it, and copies none that fails."""
    writer, reader = shm_pair(isa, isa)
    src, dst = caches(torch.bfloat16), caches(torch.bfloat16, "zeros")
    save_in_place(HostCopier(src, writer.layout, 4, isa=isa), writer, SRC, H[:5], SLOTS)
    damage(reader, SLOTS[2], "flip")
    reasons, crcs = reader.check_headers(SLOTS, H[:5])
    assert reasons == [None] * 5  # headers only: the flipped payload bit is not seen here
    intact = HostCopier(dst, reader.layout, 4, isa=isa).scatter_from(
        np.array(DST), reader.payload_records(), np.array(SLOTS), crcs
    )
    assert intact.tolist() == [True, True, False, True, True]
    assert all(same_block(src, SRC[i], dst, DST[i]) for i in (0, 1, 3, 4))
    assert all(not x.any() for x in block(dst, DST[2]))


def test_seal_writes_the_checksum_of_what_was_copied_and_begin_write_forgets_it(shm_pair):
    writer, reader = shm_pair("auto", None)
    if not kv_record_kernel().hw_crc:
        pytest.skip("no hardware CRC32C: the copier leaves checksums to seal")
    lay = writer.layout
    records = writer.payload_records()
    src = caches(torch.bfloat16)
    copier = HostCopier(src, lay, 4)
    writer.begin_write([2, 6])
    copier.gather_into(np.array([4, 9]), records, np.array([2, 6]))
    assert [int(records.noted_crcs[s]) for s in (2, 6)] == [crc32c.crc32c(records[s].tobytes()) for s in (2, 6)]
    assert records[1:3].noted_crcs is None  # a view takes no notes
    records[6, 5] ^= 1  # written behind the copier's back: the header keeps what was copied, a miss
    writer.seal([2, 6], [H[0], H[1]])
    assert (records.noted_crcs == -1).all()
    assert reader.verify([2, 6], [H[0], H[1]]) == [None, "checksum mismatch"]
    writer.begin_write([6])
    copier.gather_into(np.array([9]), records, np.array([6]))
    writer.begin_write([6])  # a new save: what the last copy noted no longer counts
    assert records.noted_crcs[6] == -1
    records[6, 5] ^= 1
    writer.seal([6], [H[1]])  # checksummed as it is now
    assert reader.verify([6], [H[1]]) == [None]


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("kernel_writes", [True, False])
def test_rows_written_and_read_in_batches_are_the_same_records(shm_pair, isa, kernel_writes):
    """write_many / read_many_into (the CUDA mover's path, through staging rows) at this level, the
    other side without the kernel."""
    writer, reader = shm_pair(isa, None) if kernel_writes else shm_pair(None, isa)
    rows = np.random.default_rng(0).integers(0, 256, (3, writer.layout.payload_nbytes), dtype=np.uint8)
    writer.write_many([4, 0, 6], H[:3], rows)
    damage(reader, 0, "flip")
    out = np.zeros_like(rows)
    assert reader.read_many_into([6, 0, 4, 5], [H[2], H[1], H[7], H[3]], np.zeros((4, rows.shape[1]), np.uint8)) == [
        None, "checksum mismatch", "hash mismatch", "missing",
    ]  # fmt: skip
    assert reader.read_many_into([6, 4], [H[2], H[0]], out[:2]) == [None, None]
    assert np.array_equal(out[0], rows[2]) and np.array_equal(out[1], rows[0])
