"""The offload connector, in-process, tiny model: evicted prefixes come back from the store, token-exact.

Every test shares one long prefix (10 blocks) between a first request and a
later one, with a KV cache of 20 blocks that filler requests flush in between,
so the later request's prefix can only come from the store.
"""

from __future__ import annotations

import threading

import pytest

from asyncpp.config import config_from_dict
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SPLITS = {1: (), 2: (1, 3), 3: (1, 1, 2)}
BLOCK = 16
PREFIX = [(7 * i + 3) % 300 + 3 for i in range(10 * BLOCK)]
FIRST = PREFIX + list(range(40, 60))
LATER = PREFIX + list(range(200, 230))
FILLERS = [[(11 * i + k) % 290 + 5 for i in range(200)] for k in (1, 2)]


def engine(tiny_hf_dir, pp_size: int = 2, **kv) -> Engine:
    kv = {"connector": "offload", "store_size_mb": 1, **kv}
    return Engine(
        tiny_config(
            tiny_hf_dir,
            parallel={"pp_size": pp_size, "layer_split": SPLITS[pp_size]},
            cache={"num_kv_blocks_override": 20},
            kv_transfer=kv,
        )
    )


def run(e: Engine, prompt: list[int]) -> list[int]:
    return e.generate([prompt], GREEDY)[0].token_ids


def first_then_flush(e: Engine) -> None:
    run(e, FIRST)
    for filler in FILLERS:  # 13 blocks each: nothing of FIRST stays in a 20-block cache
        run(e, filler)


@pytest.fixture(scope="module")
def expected(tiny_hf_dir):
    plain = Engine(tiny_config(tiny_hf_dir, cache={"num_kv_blocks_override": 20}))
    return run(plain, LATER)


def store_counts(e: Engine) -> dict:
    s = e.kv_connector.stats()
    return {k: s[k] for k in ("kv_store_pending_blocks", "kv_store_pinned_blocks")}


@pytest.mark.parametrize("load", ["async", "sync"])
@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_evicted_prefix_loads_from_the_store(tiny_hf_dir, expected, pp_size, load):
    """async: the request waits for its load; sync: the load and the suffix share one plan."""
    e = engine(tiny_hf_dir, pp_size, options={"load": load})
    first_then_flush(e)
    before = e.scheduler.stats()
    assert run(e, LATER) == expected
    after = e.scheduler.stats()
    local = after.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens
    external = after.num_external_prefix_hit_tokens - before.num_external_prefix_hit_tokens
    assert external > 0 and local + external == len(PREFIX)  # computed only the suffix
    stats = e.kv_stats()
    assert stats["kv_blocks_loaded"] == pp_size * external // BLOCK  # each stage loads its layers
    assert stats["kv_blocks_saved"] > 0 and stats["kv_bytes_saved"] > 0 and stats["kv_load_time_s"] > 0
    assert store_counts(e) == {"kv_store_pending_blocks": 0, "kv_store_pinned_blocks": 0}
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    e.close()


def test_directory_store_survives_a_restart_and_corruption_is_a_miss(tiny_hf_dir, expected, tmp_path):
    store = {"store": "dir", "store_path": str(tmp_path / "kv")}
    e = engine(tiny_hf_dir, 2, **store)
    first_then_flush(e)
    e.close()

    restarted = engine(tiny_hf_dir, 2, **store)  # a new engine: its own cache is empty
    assert restarted.kv_connector.stats()["kv_store_ready_blocks"] > 0
    assert run(restarted, LATER) == expected
    assert restarted.scheduler.stats().num_external_prefix_hit_tokens == len(PREFIX)
    restarted.close()

    # Flip one byte of the 4th prefix block's record on stage 1, truncate another's on stage 0.
    reader = engine(tiny_hf_dir, 2, **store)
    index = reader.kv_connector.index
    reader.close()
    from asyncpp.kv.block_hash import hash_block

    hashes, parent = [], None
    for i in range(10):
        parent = hash_block(parent, PREFIX[i * BLOCK : (i + 1) * BLOCK])
        hashes.append(parent)
    dirs = sorted((tmp_path / "kv").iterdir())
    flipped = dirs[1] / f"slot-{index.slot_of(hashes[3]):08d}.kv"
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = dirs[0] / f"slot-{index.slot_of(hashes[6]):08d}.kv"
    truncated.write_bytes(truncated.read_bytes()[:500])

    damaged = engine(tiny_hf_dir, 2, **store)
    assert run(damaged, LATER) == expected
    stats = damaged.scheduler.stats()
    assert stats.num_external_prefix_hit_tokens == 3 * BLOCK  # blocks before the first bad one
    # The rest is recomputed (the store also holds LATER's 11th block now, from the run above).
    assert stats.num_failed_load_tokens == ((len(LATER) - 1) // BLOCK - 3) * BLOCK
    damaged.close()
    healed = engine(tiny_hf_dir, 2, **store)  # the recompute saved the bad blocks again
    assert healed.kv_connector.index.lookup(hashes) == 10
    assert run(healed, LATER) == expected
    assert healed.scheduler.stats().num_external_prefix_hit_tokens == (len(LATER) - 1) // BLOCK * BLOCK
    healed.close()


def test_abort_during_load_and_during_save_frees_everything(tiny_hf_dir):
    e = engine(tiny_hf_dir, 2)
    first_then_flush(e)
    workers = [r.kv_connector.connector for r in e.executor.runners]
    gate = threading.Event()
    for w in workers:
        read_into = w.store.read_into
        w.store.read_into = lambda *a, _r=read_into: (gate.wait(10), _r(*a))[1]
    rid = e.add_request(LATER, GREEDY)
    while not any(w.num_loads_in_flight for w in workers):
        e.step()
    assert e.scheduler.stats().num_waiting_for_remote_kvs == 1
    e.abort(rid)
    assert e.block_manager.has_blocks(rid)  # the load still writes into them
    gate.set()
    while e.has_pending_transfers():
        e.step()
    assert not e.block_manager.has_blocks(rid)
    assert store_counts(e) == {"kv_store_pending_blocks": 0, "kv_store_pinned_blocks": 0}

    gate.clear()
    for w in workers:
        write = w.store.write
        w.store.write = lambda *a, _w=write: (gate.wait(10), _w(*a))
    rid = e.add_request([5 + i % 250 for i in range(100)], GREEDY)
    while not any(w.num_saves_in_flight for w in workers):
        e.step()
    e.abort(rid)
    assert e.block_manager.has_blocks(rid) and e.scheduler.num_held_for_transfer == 1  # saves read them
    gate.set()
    while e.has_pending_transfers():
        e.step()
    assert not e.block_manager.has_blocks(rid)
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    assert store_counts(e) == {"kv_store_pending_blocks": 0, "kv_store_pinned_blocks": 0}
    e.close()


@pytest.mark.parametrize("load", ["async", "sync"])
def test_a_load_that_raises_is_recomputed(tiny_hf_dir, expected, load):
    """sync: the plan that read the missing KV is dropped and the request computed again."""
    e = engine(tiny_hf_dir, 3, options={"load": load})
    first_then_flush(e)
    worker = e.executor.runners[1].kv_connector.connector

    def broken(*args):
        raise OSError("disk on fire")

    # Every read path of the store: one block (`read_into`), a batch, and the shm store's in-place check.
    worker.store.read_into = worker.store.read_many_into = worker.store.verify = worker.store.check_headers = broken
    assert run(e, LATER) == expected
    stats = e.scheduler.stats()
    assert stats.num_external_prefix_hit_tokens == 0 and stats.num_failed_load_tokens > 0
    e.close()


def test_multi_connector_saves_to_both_and_waits_for_both(tiny_hf_dir, expected, tmp_path):
    import tests.kv_transfer.connectors  # noqa: F401

    kv = {
        "connector": "multi",
        "module": "tests.kv_transfer.connectors",
        "children": [
            {"connector": "offload", "store_size_mb": 1},
            {"connector": "offload", "store": "dir", "store_path": str(tmp_path / "kv"), "store_size_mb": 1},
            {"connector": "staggered", "options": {"delay_steps": 3}},
        ],
    }
    e = Engine(
        tiny_config(
            tiny_hf_dir,
            parallel={"pp_size": 2, "layer_split": (2, 2)},
            cache={"num_kv_blocks_override": 20},
            kv_transfer=config_from_dict({"kv_transfer": kv}).kv_transfer,  # children as tables
        )
    )
    shm_child, dir_child, staggered = e.kv_connector.children
    rid = e.add_request(FIRST, GREEDY)
    held_steps = 0
    while e.has_unfinished_requests() or e.has_pending_transfers():
        e.step()
        if rid in staggered.finished and rid not in staggered.finished_sending_at:
            held_steps += 1
            assert e.block_manager.has_blocks(rid)
    assert held_steps >= 2 * 3  # the staggered child's last stage reports 6 polls after the finish
    assert shm_child.index.num_ready == dir_child.index.num_ready == (len(FIRST) + 8 - 1) // BLOCK
    for filler in FILLERS:
        run(e, filler)
    assert run(e, LATER) == expected
    assert e.scheduler.stats().num_external_prefix_hit_tokens > 0
    e.close()


@pytest.mark.parametrize("load", ["async", "sync"])
def test_requests_sharing_a_stored_prefix_load_it_once(tiny_hf_dir, expected, load):
    """The second waits for the first's load (sync: not even that, it hits the blocks the first
    loads within the same plan), then hits the engine's own cache: no second copy."""
    e = engine(tiny_hf_dir, 2, options={"load": load})
    first_then_flush(e)
    before = e.scheduler.stats()
    outs = e.generate([LATER, LATER], GREEDY)
    assert [o.token_ids for o in outs] == [expected, expected]
    after = e.scheduler.stats()
    assert after.num_external_prefix_hit_tokens - before.num_external_prefix_hit_tokens == len(PREFIX)  # once
    assert after.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens >= len(PREFIX)  # the second one
    e.close()
