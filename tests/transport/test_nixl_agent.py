"""`NixlTransport` between two agents in one process, on CPU paged caches: block reads (in runs and
scattered) land bit for bit, one transfer per read, the notif reaches the remote once, bad arguments
raise `ValueError`, a closed remote fails a read instead of hanging, release waits out a running read,
close is idempotent. `block_runs` merges consecutive block pairs."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from asyncpp.transport.nixl_agent import NixlTransport, TransferState, block_runs

pytest.importorskip("nixl_cu12")

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 32, 4, 3, 8
DEADLINE_S = 5.0


# ---- block_runs --------------------------------------------------------------------------------
def test_consecutive_pairs_merge_into_one_run():
    assert block_runs([3, 4, 5], [10, 11, 12], 1000, 5000, 100) == [(1300, 6000, 300)]


def test_runs_break_where_either_side_jumps():
    runs = block_runs([0, 1, 2, 3, 7], [5, 6, 9, 10, 11], 0, 0, 10)
    assert runs == [(0, 50, 20), (20, 90, 20), (70, 110, 10)]


def test_pairs_merge_in_whatever_order_they_come():
    assert block_runs([5, 3, 4], [12, 10, 11], 0, 0, 1) == [(3, 10, 3)]


def test_scattered_blocks_give_one_run_each():
    assert block_runs([9, 2], [0, 7], 0, 0, 4) == [(8, 28, 4), (36, 0, 4)]
    assert block_runs([], [], 0, 0, 4) == []


def test_mismatched_or_repeated_blocks_are_refused():
    with pytest.raises(ValueError, match="local blocks"):
        block_runs([1, 2], [1], 0, 0, 4)
    with pytest.raises(ValueError, match="two copies"):
        block_runs([1, 1], [2, 3], 0, 0, 4)


# ---- two agents --------------------------------------------------------------------------------
def caches(fill: bool, seed: int = 0) -> list[torch.Tensor]:
    """K and V of every layer, each [num_blocks * block_size, heads, head_dim] bfloat16."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS * BLOCK_SIZE, HEADS, HEAD_DIM)
    if fill:
        return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2 * NUM_LAYERS)]
    return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * NUM_LAYERS)]


def blocks(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return t.view(NUM_BLOCKS, -1)[ids]


def pull_runs(dst: list[torch.Tensor], src: list[torch.Tensor], local_ids, remote_ids) -> list[tuple[int, int, int]]:
    block_nbytes = dst[0][:BLOCK_SIZE].nbytes
    return [r for d, s in zip(dst, src) for r in block_runs(local_ids, remote_ids, d.data_ptr(), s.data_ptr(), block_nbytes)]


def wait_for(fn, deadline_s: float = DEADLINE_S):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if value := fn():
            return value
        time.sleep(0.001)
    raise AssertionError(f"nothing within {deadline_s} s")


def finish(transport: NixlTransport, handle) -> TransferState:
    return wait_for(lambda: (s := transport.poll(handle)) is not TransferState.RUNNING and s)


@pytest.fixture
def pair():
    """(prefill, decode, their caches): decode has added prefill; both closed after the test."""
    tag = uuid.uuid4().hex[:6]
    prefill, decode = NixlTransport(f"prefill-{tag}"), NixlTransport(f"decode-{tag}")
    src, dst = caches(fill=True), caches(fill=False)
    regions = prefill.register(src)
    decode.register(dst)
    assert [(r.addr, r.nbytes, r.is_cuda) for r in regions] == [(t.data_ptr(), t.nbytes, False) for t in src]
    assert decode.add_remote(prefill.agent_metadata()) == prefill.name
    yield prefill, decode, src, dst
    decode.close()
    prefill.close()


@pytest.mark.parametrize("placement", ["runs", "scattered"])
def test_a_read_copies_the_blocks_bit_for_bit_in_one_transfer(pair, placement):
    prefill, decode, src, dst = pair
    rng = np.random.default_rng(1)
    for _ in range(3):
        if placement == "runs":
            local_ids, remote_ids = list(range(3, 11)) + [20, 21], list(range(12, 20)) + [5, 6]
        else:
            local_ids, remote_ids = (rng.choice(NUM_BLOCKS, 9, replace=False).tolist() for _ in range(2))
        runs = pull_runs(dst, src, local_ids, remote_ids)
        handle = decode.read(prefill.name, runs, notif=b"req-1")
        assert handle.num_descs == len(runs) and handle.nbytes == len(local_ids) * dst[0][:BLOCK_SIZE].nbytes * len(dst)
        assert finish(decode, handle) is TransferState.DONE
        decode.release(handle)
        for d, s in zip(dst, src):
            assert torch.equal(blocks(d, local_ids), blocks(s, remote_ids))
            others = [b for b in range(NUM_BLOCKS) if b not in local_ids]
            assert not blocks(d, others).any()
            d.zero_()
    if placement == "runs":
        assert len(runs) == 2 * len(dst)  # one descriptor per run of blocks per tensor


def test_the_notif_reaches_the_remote_once_after_the_read(pair):
    prefill, decode, src, dst = pair
    handle = decode.read(prefill.name, pull_runs(dst, src, [0, 1], [4, 5]), notif=b"done:req-7")
    assert finish(decode, handle) is TransferState.DONE
    assert wait_for(prefill.get_notifs) == [b"done:req-7"]
    silent = decode.read(prefill.name, pull_runs(dst, src, [2], [6]))  # no notif asked
    assert finish(decode, silent) is TransferState.DONE
    time.sleep(0.05)
    assert prefill.get_notifs() == []
    decode.release(handle)
    decode.release(silent)


def test_standalone_and_empty_read_notifs_arrive(pair):
    prefill, decode, _, _ = pair
    decode.send_notif(prefill.name, b"free:req-1")
    empty = decode.read(prefill.name, [], notif=b"free:req-2")  # nothing to pull, the remote still hears
    assert decode.poll(empty) is TransferState.DONE
    got: list[bytes] = []
    wait_for(lambda: got.extend(prefill.get_notifs()) or len(got) >= 2)
    assert sorted(got) == [b"free:req-1", b"free:req-2"]


def test_unknown_remotes_and_runs_outside_registered_memory_are_refused(pair):
    prefill, decode, src, dst = pair
    run = (dst[0].data_ptr(), src[0].data_ptr(), 64)
    with pytest.raises(ValueError, match="unknown remote"):
        decode.read("nobody", [run])
    with pytest.raises(ValueError, match="unknown remote"):
        decode.send_notif("nobody", b"x")
    outside_local = [
        (dst[0].data_ptr() - 64, src[0].data_ptr(), 64),  # before the region
        (dst[0].data_ptr() + dst[0].nbytes - 32, src[0].data_ptr(), 64),  # across its end
        (dst[0].data_ptr(), src[0].data_ptr(), 0),
    ]
    for bad in outside_local:
        with pytest.raises(ValueError, match="registered local memory"):
            decode.read(prefill.name, [run, bad])
    with pytest.raises(ValueError, match="registered"):
        decode.read(prefill.name, [(dst[0].data_ptr(), src[0].data_ptr() + src[0].nbytes - 32, 64)])
    with pytest.raises(ValueError, match="already registered"):
        decode.register([dst[0]])
    with pytest.raises(ValueError, match="contiguous"):
        decode.register([torch.zeros(8, 8).t()])


def test_a_read_from_a_closed_remote_fails_and_never_hangs(pair):
    prefill, decode, src, dst = pair
    warm = decode.read(prefill.name, pull_runs(dst, src, [0], [0]))
    assert finish(decode, warm) is TransferState.DONE
    prefill.close()
    handle = decode.read(prefill.name, pull_runs(dst, src, [1, 2], [1, 2]), notif=b"x")
    assert finish(decode, handle) is TransferState.FAILED
    decode.release(handle)
    decode.release(warm)
    with pytest.raises(RuntimeError, match="closed"):
        prefill.get_notifs()


def test_release_of_a_running_read_returns_once_it_landed(monkeypatch):
    # UCX's tcp transport keeps a large read running after it was posted (host memory otherwise moves
    # inside the post); NIXL's release would leave it writing, ours waits it out.
    monkeypatch.setenv("UCX_TLS", "tcp")
    tag = uuid.uuid4().hex[:6]
    with NixlTransport(f"p-{tag}") as prefill, NixlTransport(f"d-{tag}") as decode:
        src = torch.randint(0, 255, (32 << 20,), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        prefill.register([src])
        decode.register([dst])
        remote = decode.add_remote(prefill.agent_metadata())
        handle = decode.read(remote, [(dst.data_ptr(), src.data_ptr(), src.nbytes)], notif=b"n")
        decode.release(handle)
        assert torch.equal(dst, src)
        snapshot = dst.clone()
        time.sleep(0.05)
        assert torch.equal(dst, snapshot)
        assert decode.poll(handle) is TransferState.DONE
        decode.release(handle)  # twice: a no-op
        assert wait_for(prefill.get_notifs) == [b"n"]


def test_add_remote_is_idempotent_and_a_restarted_peer_needs_remove_first(pair):
    prefill, decode, _, _ = pair
    assert decode.add_remote(prefill.agent_metadata()) == prefill.name
    name = prefill.name
    prefill.close()
    with NixlTransport(name) as restarted:  # the name is free again once closed
        restarted.register([torch.zeros(64, dtype=torch.uint8)])
        with pytest.raises(ValueError, match="remove_remote"):
            decode.add_remote(restarted.agent_metadata())
        decode.remove_remote(name)
        decode.remove_remote(name)  # unknown names are ignored
        assert decode.add_remote(restarted.agent_metadata()) == name


def test_names_are_unique_per_process_and_close_is_idempotent():
    name = f"solo-{uuid.uuid4().hex[:6]}"
    transport = NixlTransport(name)
    with pytest.raises(ValueError, match="already open"):
        NixlTransport(name)
    transport.register([torch.zeros(16)])
    transport.close()
    transport.close()
    with pytest.raises(RuntimeError, match="closed"):
        transport.agent_metadata()
    NixlTransport(name).close()
