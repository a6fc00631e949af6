"""BlockManager: accounting, exhaustion, prefix caching and LRU eviction."""

from __future__ import annotations

import random

import pytest

from asyncpp.kv.block_manager import BlockManager

BS = 4  # block size used throughout


def _start(bm: BlockManager, request_id: str, token_ids: list[int], num_new_tokens: int | None = None) -> list[int] | None:
    """Admit a request the way the scheduler does: prefix lookup, then allocate."""
    hit_ids, num_hit_tokens = bm.get_computed_blocks(token_ids)
    if num_new_tokens is None:
        num_new_tokens = len(token_ids) - num_hit_tokens
    return bm.allocate_slots(request_id, token_ids, num_new_tokens, num_hit_tokens, hit_ids)


def _check_accounting(bm: BlockManager, tables: list[list[int]]) -> None:
    for block_id in range(bm.num_blocks):
        assert bm.ref_count(block_id) == sum(t.count(block_id) for t in tables)
    num_used = sum(1 for b in range(bm.num_blocks) if bm.ref_count(b) > 0)
    assert bm.num_free_blocks + num_used == bm.num_blocks


def test_allocate_and_free_accounting() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    table = bm.allocate_slots("a", list(range(10)), num_new_tokens=10, num_computed_tokens=0)
    assert table is not None and len(table) == 3  # ceil(10 / 4)
    assert len(set(table)) == 3
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    # Growing by tokens that still fit the last block allocates nothing.
    assert bm.allocate_slots("a", list(range(12)), num_new_tokens=2, num_computed_tokens=10) == table
    # One more token needs a fourth block; the table keeps its prefix.
    grown = bm.allocate_slots("a", list(range(13)), num_new_tokens=1, num_computed_tokens=12)
    assert grown is not None and grown[:3] == table and len(grown) == 4
    assert bm.block_ids("a") == grown
    b_table = bm.allocate_slots("b", [1, 2], num_new_tokens=2, num_computed_tokens=0)
    assert b_table is not None and not set(b_table) & set(grown)
    _check_accounting(bm, [grown, b_table])
    bm.free("a")
    assert bm.num_free_blocks == 9 and bm.block_ids("a") == []
    bm.free("a")  # unknown / already freed: no-op
    bm.free("b")
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    _check_accounting(bm, [])


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))  # 2 full blocks + 1 token
    table = _start(bm, "a", prompt)
    assert table is not None and len(table) == 3
    num_cached = bm.num_cached_blocks
    assert num_cached == 2
    # "b" needs 3 blocks, only 1 is free.
    other = [100 + t for t in range(9)]
    assert _start(bm, "b", other) is None
    assert bm.block_ids("b") == []
    assert bm.num_free_blocks == 1 and bm.num_cached_blocks == num_cached
    # Growing "a" by 8 tokens needs 2 more blocks: refused, table untouched.
    longer = prompt + list(range(50, 58))
    assert bm.allocate_slots("a", longer, num_new_tokens=8, num_computed_tokens=9) is None
    assert bm.block_ids("a") == table and bm.num_free_blocks == 1
    _check_accounting(bm, [table])


def test_failed_first_allocation_keeps_hit_blocks_free_and_cached() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt = list(range(9))
    assert _start(bm, "a", prompt) is not None
    bm.free("a")
    assert bm.allocate_slots("f", [5] * 4, num_new_tokens=4, num_computed_tokens=0) is not None
    # 2 free blocks left, both cached blocks of "a" (its unhashed tail was reused first).
    hit_ids, num_hit = bm.get_computed_blocks(prompt + [1, 2, 3, 4])
    assert num_hit == 8
    # 13 tokens need 4 blocks: 2 revived + 2 new > 2 free.
    assert bm.allocate_slots("c", prompt + [1, 2, 3, 4], 5, num_hit, hit_ids) is None
    assert bm.num_free_blocks == 2 and all(bm.ref_count(b) == 0 for b in hit_ids)
    assert bm.get_computed_blocks(prompt)[1] == 8  # still cached


def test_repeated_prompt_hits_prefix_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks + 2
    table_a = _start(bm, "a", prompt)
    assert table_a is not None
    assert bm.num_prefix_cache_hit_tokens == 0 and bm.num_prefix_cache_queries_tokens == 14
    hit_ids, num_hit = bm.get_computed_blocks(prompt)
    assert num_hit == 12 and hit_ids == table_a[:3]
    table_b = bm.allocate_slots("b", prompt, len(prompt) - num_hit, num_hit, hit_ids)
    assert table_b is not None and table_b[:3] == table_a[:3] and table_b[3] != table_a[3]
    assert bm.num_prefix_cache_queries_tokens == 28 and bm.num_prefix_cache_hit_tokens == 12
    assert bm.prefix_cache_hit_rate == pytest.approx(12 / 28)
    for block_id in table_a[:3]:
        assert bm.ref_count(block_id) == 2
    _check_accounting(bm, [table_a, table_b])
    bm.free("a")
    assert all(bm.ref_count(b) == 1 for b in table_b)  # shared blocks still owned by "b"
    bm.free("b")
    assert bm.num_free_blocks == 16


def test_hash_is_chained_over_the_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    assert _start(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0]) is not None
    # Same second block [5, 6, 7, 8] after a different first block: no hit at all.
    assert bm.get_computed_blocks([9, 9, 9, 9, 5, 6, 7, 8, 0]) == ([], 0)
    # Same first block, different second: only the first block hits.
    hit_ids, num_hit = bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 9, 0])
    assert num_hit == 4 and hit_ids == bm.block_ids("a")[:1]


def test_partial_last_block_is_never_cached() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6]  # one full block + 2 tokens
    assert _start(bm, "a", prompt) is not None
    assert bm.num_cached_blocks == 1
    # Even a longer prompt sharing all 6 tokens hits the full block only.
    assert bm.get_computed_blocks(prompt + [7, 8, 9])[1] == 4
    # Once decode fills the block it becomes cached.
    assert bm.allocate_slots("a", prompt + [7, 8], num_new_tokens=2, num_computed_tokens=6) is not None
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(prompt + [7, 8, 9])[1] == 8


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    assert _start(bm, "a", prompt) is not None
    assert bm.num_cached_blocks == 2
    hit_ids, num_hit = bm.get_computed_blocks(prompt)
    assert num_hit == 4 and len(hit_ids) == 1  # the last block is recomputed for the logits
    assert bm.get_computed_blocks(prompt + [99])[1] == 8
    assert bm.get_computed_blocks(prompt[:1]) == ([], 0)
    assert bm.get_computed_blocks([]) == ([], 0)


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    assert _start(bm, "a", prompt) is not None
    assert bm.get_computed_blocks(prompt) == ([], 0)
    assert bm.num_cached_blocks == 0


def test_freed_cached_blocks_are_reused_by_identical_prompt() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    table_a = _start(bm, "a", prompt)
    assert table_a is not None
    bm.free("a")
    assert bm.num_free_blocks == 8
    table_b = _start(bm, "b", prompt)
    assert table_b is not None and table_b[:2] == table_a[:2]
    assert bm.num_prefix_cache_hit_tokens == 8


def test_lru_eviction_order_and_eviction_removes_hash() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    seq_a = [1] * 4 + [2] * 4 + [3]  # 2 full blocks + 1 token
    seq_b = [4] * 4 + [5] * 4 + [6]
    table_a = _start(bm, "a", seq_a)
    table_b = _start(bm, "b", seq_b)
    assert table_a is not None and table_b is not None
    bm.free("a")  # freed first: least recently used
    bm.free("b")
    # The two unhashed tail blocks go first, then a's blocks tail-first, then b's.
    expected_order = [table_b[2], table_a[2], table_a[1], table_a[0], table_b[1], table_b[0]]
    taken = []
    for i in range(6):
        table = bm.allocate_slots(f"x{i}", [100 + i], num_new_tokens=1, num_computed_tokens=0)
        assert table is not None
        taken.append(table[0])
        if i == 2:
            # a's second block is evicted: only its first block still hits, b fully hits.
            assert bm.get_computed_blocks(seq_a)[1] == 4
            assert bm.get_computed_blocks(seq_b)[1] == 8
    assert sorted(taken[:2]) == sorted(expected_order[:2])
    assert taken[2:] == expected_order[2:]
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(seq_a) == ([], 0)
    assert bm.get_computed_blocks(seq_b) == ([], 0)


def test_hit_moves_block_out_of_the_free_queue() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = [1] * 4 + [2]
    assert _start(bm, "a", seq) is not None
    bm.free("a")
    table_b = _start(bm, "b", seq)
    assert table_b is not None and bm.ref_count(table_b[0]) == 1
    # The hit block is owned now: filling the rest of the cache never takes it.
    filler = bm.allocate_slots("f", [0] * 8, num_new_tokens=8, num_computed_tokens=0)
    assert filler is not None and table_b[0] not in filler
    assert bm.allocate_slots("g", [0], num_new_tokens=1, num_computed_tokens=0) is None


def test_identical_blocks_filled_concurrently_keep_one_cached_copy() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = list(range(9))
    table_a = bm.allocate_slots("a", seq, 9, 0)  # no lookup: both compute the same blocks
    table_b = bm.allocate_slots("b", seq, 9, 0)
    assert table_a is not None and table_b is not None
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(seq)[0] == table_a[:2]
    bm.free("a")
    # b's duplicate blocks are unhashed; chaining from them still registers b's later blocks.
    longer = seq + [50, 51, 52]
    assert bm.allocate_slots("b", longer, 3, 9) is not None
    assert bm.num_cached_blocks == 3
    assert bm.get_computed_blocks(longer + [0])[1] == 12


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = list(range(5))
    assert _start(bm, "a", seq) is not None
    assert bm.reset_prefix_cache() is False  # blocks in use
    assert bm.num_cached_blocks == 1
    bm.free("a")
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_blocks == 0 and bm.get_computed_blocks(seq) == ([], 0)


def test_argument_validation() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
    bm = BlockManager(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="cannot cover"):
        bm.allocate_slots("a", [1, 2], num_new_tokens=3, num_computed_tokens=0)
    with pytest.raises(ValueError, match="computed blocks"):
        bm.allocate_slots("a", [1, 2, 3, 4, 5], num_new_tokens=1, num_computed_tokens=4)


def test_quarantined_blocks_leave_the_free_queue_and_the_cache_until_each_read_is_released() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(1, 10))  # 2 full blocks and 1 token
    table = _start(bm, "a", prompt)
    bm.free("a")  # its full blocks stay cached in the free queue
    assert bm.get_computed_blocks(prompt)[1] == 8
    bm.quarantine([table[0], table[0], table[2]])  # two reads into block 0, one into block 2
    assert bm.num_quarantined_blocks == 2 and bm.num_free_blocks == 2
    assert bm.get_computed_blocks(prompt) == ([], 0)  # block 0's KV is not trusted: no hit
    assert _start(bm, "b", list(range(50, 55))) is not None  # 2 blocks: the 2 not quarantined
    assert set(bm.block_ids("b")).isdisjoint({table[0], table[2]})
    assert _start(bm, "c", [7]) is None  # nothing else is free
    other = next(b for b in range(4) if b not in (table[0], table[2]))  # b's, never quarantined
    assert bm.release_quarantine([table[0], table[2], other]) == [other]  # returned, ignored
    assert bm.num_quarantined_blocks == 1 and bm.num_free_blocks == 1  # block 2 back, block 0 still read once
    bm.release_quarantine([table[0]])
    assert bm.num_quarantined_blocks == 0 and bm.num_free_blocks == 2
    bm.free("b")
    _check_accounting(bm, [])


@pytest.mark.parametrize("seed", range(6))
def test_covering_table_is_allocate_slots_when_there_is_nothing_to_do(seed: int) -> None:
    """Two managers grow the same requests step by step (decode tokens, placeholders past the known
    tokens, shared prefixes): one asks `covering_table` first, the other always `allocate_slots`.
    They return the same tables and end in the same state, across block boundaries and hashing."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    caching = seed % 3 != 2
    fast, slow = (BlockManager(64, block_size, enable_prefix_caching=caching) for _ in range(2))
    prefix = [rng.randrange(50) for _ in range(3 * block_size)]
    tokens = {f"r{i}": prefix[: rng.randrange(len(prefix))] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
              for i in range(4)}  # fmt: skip
    computed = dict.fromkeys(tokens, 0)
    num_fast_hits = 0
    for _ in range(60):
        request_id = rng.choice(list(tokens))
        token_ids = tokens[request_id]
        if computed[request_id] == 0:
            for bm in (fast, slow):
                assert _start(bm, request_id, token_ids) is not None
            computed[request_id] = len(token_ids)
            continue
        num_lookahead = rng.choice([0, 1, 1, 2])  # placeholders of plans in flight
        num_new = rng.randrange(1, 3)
        if computed[request_id] + num_new > len(token_ids) + num_lookahead:
            token_ids.append(rng.randrange(50))  # a sampled token arrives
            continue
        num_total = computed[request_id] + num_new
        table = fast.covering_table(request_id, num_total, len(token_ids))
        expected = slow.allocate_slots(request_id, token_ids, num_new, computed[request_id], num_lookahead_tokens=num_lookahead)
        if table is None:
            table = fast.allocate_slots(request_id, token_ids, num_new, computed[request_id], num_lookahead_tokens=num_lookahead)
        else:
            num_fast_hits += 1
        assert table == expected
        if expected is not None:
            computed[request_id] = num_total
        for request in tokens:
            assert fast.block_ids(request) == slow.block_ids(request) and fast.block_hashes(request) == slow.block_hashes(request)
        assert fast._free_queue == slow._free_queue and fast._cached_block_by_hash == slow._cached_block_by_hash
    assert num_fast_hits > 0 or block_size == 1
