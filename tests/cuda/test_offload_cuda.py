"""The offload `BlockMover` on a CUDA cache (`cuda` mark: skipped without a GPU).

- bfloat16 blocks go to both stores through pinned staging and come back bit-exact, a damaged
  record being a miss of its block only;
- a save waits for its `ready` event: blocks written on the compute stream by work enqueued
  before the event (behind a long run of matrix products) are saved with those writes;
- a load is complete when it returns: a read enqueued on the compute stream right after sees
  the loaded values.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
import torch

from asyncpp.kv_transfer.offload.mover import BlockMover
from asyncpp.kv_transfer.offload.store import (
    DirBlockStore, HEADER_NBYTES, ShmBlockStore, StoreLayout, store_fingerprint,
)

pytestmark = pytest.mark.cuda

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS, NUM_SLOTS = 4, 16, 3, 64, 256, 128
DTYPE = "bfloat16"
H = [bytes([i % 251 + 1, i // 251]) * 16 for i in range(NUM_SLOTS)]


def layout() -> StoreLayout:
    return StoreLayout(NUM_SLOTS, LAYERS, BLOCK, HEADS, DIM, DTYPE, store_fingerprint("m", 0, LAYERS, DTYPE, BLOCK, HEADS, DIM))


def cuda_caches(fill: str = "randn", seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS * BLOCK, HEADS, DIM)

    def make() -> torch.Tensor:
        t = torch.randn(shape, generator=g) if fill == "randn" else torch.zeros(shape)
        return t.to(torch.bfloat16).cuda()

    return [(make(), make()) for _ in range(LAYERS)]


def block(kv_caches, b: int) -> list[torch.Tensor]:
    rows = slice(b * BLOCK, (b + 1) * BLOCK)
    return [cache[rows].view(torch.int16).cpu() for pair in kv_caches for cache in pair]


def same_block(a, b_a: int, b, b_b: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(block(a, b_a), block(b, b_b)))


@pytest.fixture(params=["shm", "dir"])
def store(request, tmp_path):
    if request.param == "shm":
        s = ShmBlockStore(f"asyncpp-test-kvcuda-{os.getpid()}-{uuid.uuid4().hex[:8]}", layout(), create=True)
    else:
        s = DirBlockStore(tmp_path, layout())
    yield s
    s.close()
    if isinstance(s, ShmBlockStore):
        s.unlink()


def test_cuda_blocks_round_trip_bit_exact_through_pinned_staging(store):
    src, dst = cuda_caches(), cuda_caches("zeros")
    g = torch.Generator().manual_seed(1)
    block_ids = torch.randperm(NUM_BLOCKS, generator=g)[:40].tolist()
    targets = torch.randperm(NUM_BLOCKS, generator=g)[:40].tolist()
    slots = torch.randperm(NUM_SLOTS, generator=g)[:40].tolist()
    hashes = [H[s] for s in slots]
    chunk = 16 * store.layout.payload_nbytes  # three chunks, the last one short
    saved = BlockMover(src, BLOCK, store, chunk).save(block_ids, hashes, slots, contextlib.nullcontext)
    assert saved == 40 * store.layout.payload_nbytes
    if isinstance(store, ShmBlockStore):
        store._records[slots[7], HEADER_NBYTES + 5] ^= 1
    else:
        path = store.path(slots[7])
        data = bytearray(path.read_bytes())
        data[HEADER_NBYTES + 5] ^= 1
        path.write_bytes(bytes(data))
    failed = BlockMover(dst, BLOCK, store, chunk).load(targets, hashes, slots, contextlib.nullcontext)
    assert failed == {7: "checksum mismatch"}
    assert all(same_block(src, b, dst, t) for i, (b, t) in enumerate(zip(block_ids, targets)) if i != 7)
    assert all(not x.any() for x in block(dst, targets[7]))


def test_a_save_waits_for_the_writes_before_its_ready_event(store):
    caches = cuda_caches()
    compute = torch.cuda.Stream()
    block_ids = [3, 77, 150, 201]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        for _ in range(50):  # tens of ms of work ahead of the writes
            a = (a @ a).clamp_(-1, 1)
        for i, b in enumerate(block_ids):
            for layer, (k, v) in enumerate(caches):
                k[b * BLOCK : (b + 1) * BLOCK].fill_(i + layer / 8)
                v[b * BLOCK : (b + 1) * BLOCK].fill_(-(i + layer / 8))
        ready = torch.cuda.Event()
        ready.record(compute)
    slots = [10, 20, 30, 40]
    mover = BlockMover(caches, BLOCK, store)
    mover.save(block_ids, [H[s] for s in slots], slots, contextlib.nullcontext, ready=ready)
    assert ready.query()  # the save returned after the writes, not before
    out = torch.empty(store.layout.payload_shape, dtype=torch.bfloat16)
    for i, slot in enumerate(slots):
        assert store.read_into(slot, H[slot], out) is None
        for layer in range(LAYERS):
            assert (out[layer, 0] == torch.tensor(i + layer / 8, dtype=torch.bfloat16)).all()
            assert (out[layer, 1] == torch.tensor(-(i + layer / 8), dtype=torch.bfloat16)).all()


def test_a_load_is_complete_when_it_returns(store):
    src, dst = cuda_caches(seed=2), cuda_caches("zeros")
    block_ids = list(range(0, 2 * NUM_SLOTS, 2))  # every slot: a load big enough to race
    slots = list(range(NUM_SLOTS))
    hashes = [H[s] for s in slots]
    BlockMover(src, BLOCK, store).save(block_ids, hashes, slots, contextlib.nullcontext)
    targets = [b + 1 for b in block_ids]
    compute = torch.cuda.Stream()
    assert BlockMover(dst, BLOCK, store).load(targets, hashes, slots, contextlib.nullcontext) == {}
    with torch.cuda.stream(compute):  # enqueued right after the load returned, no synchronisation
        seen = [(k.view(NUM_BLOCKS, -1)[targets].clone(), v.view(NUM_BLOCKS, -1)[targets].clone()) for k, v in dst]
    compute.synchronize()
    for (k_seen, v_seen), (k, v) in zip(seen, src):
        assert torch.equal(k_seen.view(torch.int16), k.view(NUM_BLOCKS, -1)[block_ids].view(torch.int16))
        assert torch.equal(v_seen.view(torch.int16), v.view(NUM_BLOCKS, -1)[block_ids].view(torch.int16))
