"""`BlockManager`: owns the paged KV cache's block ids, with prefix caching.

Every pipeline stage holds `num_blocks` blocks of `block_size` token slots for
its own layers, all addressed by the same ids; this engine-side manager hands
those ids out. A request's block table maps its token position `p` to slot
`p % block_size` of block `table[p // block_size]`.

Invariants (checked by the tests after every step):
* `ref_count(b)` == number of request block tables that contain `b`, plus the
  times `b` is quarantined.
* A block is in the free queue iff its ref count is 0, so
  `num_free_blocks + number of blocks with ref > 0 == num_blocks`.
* `_cached_block_by_hash[h] == b` implies `_block_hash[b] == h`: a hash names
  at most one block, and a block loses its hash when it is re-allocated.

Prefix caching: a block is registered under its chained hash (see
`block_hash`) as soon as the tokens filling it are known, which is at
schedule time, before the stages have written its KV. That is safe because
every stage runs plans in `step_id` order, so a later plan reading the block
runs after the plan writing it. Freed cached blocks keep their hash in the
free queue and can be hit again until they are evicted.

Free queue order (the eviction order): blocks without a hash sit at the head
and are reused first (their content is worthless); cached blocks follow in
least-recently-freed order. A request frees its blocks tail first, so the end
of a sequence is evicted before its (more shareable) beginning. All queue
operations are O(1) (`OrderedDict`).

Quarantine: a block that a KV read the transport could not stop may still
write (`quarantine`) holds one reference per such read and loses its hash,
so it neither returns to the free queue nor is hit, until each read is
confirmed ended (`release_quarantine`).

Stats are in tokens: `num_prefix_cache_queries_tokens` counts the tokens of
every `get_computed_blocks` lookup, `num_prefix_cache_hit_tokens` those served
from the cache. Both only grow (a lookup retried on a later step counts again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from asyncpp.kv.block_hash import BlockHash, hash_block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached_block_by_hash: dict[BlockHash, int] = {}
        # Blocks with ref count 0, head evicted first. Values unused.
        self._free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_tables: dict[str, list[int]] = {}
        self._quarantined: dict[int, int] = {}  # block -> reads into it not confirmed ended
        # Chained hashes of the request's full blocks so far (the parent chain for the next one).
        self._request_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_prefix_cache_queries_tokens = 0
        self.num_prefix_cache_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, including evictable cached ones."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_block_by_hash)

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.num_prefix_cache_queries_tokens == 0:
            return 0.0
        return self.num_prefix_cache_hit_tokens / self.num_prefix_cache_queries_tokens

    @property
    def num_quarantined_blocks(self) -> int:
        return len(self._quarantined)

    def is_quarantined(self, block_id: int) -> bool:
        return block_id in self._quarantined

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] for a request holding none)."""
        return list(self._block_tables.get(request_id, ()))

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._block_tables

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """Hashes of the request's full blocks whose tokens are known and whose KV is (being) computed."""
        return list(self._request_block_hashes.get(request_id, ()))

    def covering_table(self, request_id: str, num_total_tokens: int, num_known_tokens: int) -> list[int] | None:
        """What `allocate_slots` returns for a request that already holds blocks covering
        `num_total_tokens`, none of them newly full of its `num_known_tokens` known tokens (nothing
        to hash): a copy of its table, nothing changed. None where `allocate_slots` has work to do.

        Most decode steps are this case (a new block every `block_size` tokens): they skip the
        argument checks and the token list `allocate_slots` needs."""
        table = self._block_tables.get(request_id)
        if table is None or len(table) * self.block_size < num_total_tokens:
            return None
        if self.enable_prefix_caching:
            num_full_blocks = min(num_total_tokens, num_known_tokens) // self.block_size
            if num_full_blocks > len(self._request_block_hashes[request_id]):
                return None
        return list(table)

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest cached run of full leading blocks: (block_ids, num_computed_tokens).

        At most `(len(token_ids) - 1) // block_size` blocks, so at least one
        token is left to compute and the model produces logits for it.
        Allocates nothing; the caller passes the ids to `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        hit_block_ids: list[int] = []
        parent: BlockHash | None = None
        for i in range(max_hit_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached_block_by_hash.get(parent)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        num_hit_tokens = len(hit_block_ids) * self.block_size
        self.num_prefix_cache_queries_tokens += len(token_ids)
        self.num_prefix_cache_hit_tokens += num_hit_tokens
        return hit_block_ids, num_hit_tokens

    # ---------------------------------------------------------------- mutations
    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_computed_tokens: int,
        computed_block_ids: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to cover `num_computed_tokens + num_new_tokens` tokens.

        `token_ids` are all tokens known for the request, and up to
        `num_lookahead_tokens` more may be covered (async scheduling: tokens
        not sampled yet). A block is hashed for prefix caching once all its
        tokens are known, by the first call after that. On its first
        allocation `computed_block_ids` (prefix-cache hits covering exactly
        `num_computed_tokens`) are shared into its table. Returns a copy of the
        whole table, or None, with nothing changed, if free blocks run short.
        """
        num_total_tokens = num_computed_tokens + num_new_tokens
        if (
            num_new_tokens < 0
            or num_computed_tokens < 0
            or num_lookahead_tokens < 0
            or num_total_tokens > len(token_ids) + num_lookahead_tokens
        ):
            raise ValueError(
                f"request {request_id!r}: cannot cover {num_computed_tokens} + {num_new_tokens} "
                f"tokens of a sequence of {len(token_ids)}"
            )
        table = self._block_tables.get(request_id)
        computed_block_ids = computed_block_ids or []
        if table is None:
            if num_computed_tokens != len(computed_block_ids) * self.block_size:
                raise ValueError(
                    f"request {request_id!r}: first allocation with {num_computed_tokens} computed tokens "
                    f"but {len(computed_block_ids)} computed blocks of {self.block_size}"
                )
            num_held_blocks = len(computed_block_ids)
            # Hits with ref 0 sit in the free queue; taking them uses up free blocks too.
            num_revived = sum(1 for b in computed_block_ids if self._ref_counts[b] == 0)
        elif computed_block_ids:
            raise ValueError(f"request {request_id!r} already holds blocks; computed_block_ids apply only at first")
        else:
            num_held_blocks = len(table)
            num_revived = 0
        num_required_blocks = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(0, num_required_blocks - num_held_blocks)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return None

        if table is None:
            table = []
            for block_id in computed_block_ids:
                self._take(block_id)
                table.append(block_id)
            self._block_tables[request_id] = table
            self._request_block_hashes[request_id] = [self._hash_of_hit(b) for b in computed_block_ids]
        for _ in range(num_new_blocks):
            table.append(self._pop_free_block())
        if self.enable_prefix_caching:
            num_full_blocks = min(num_total_tokens, len(token_ids)) // self.block_size
            if num_full_blocks > len(self._request_block_hashes[request_id]):  # most decode steps fill none
                self._register_full_blocks(request_id, table, token_ids, num_full_blocks)
        return list(table)

    def allocate_for_load(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        computed_block_ids: list[int],
        num_external_tokens: int,
    ) -> list[int] | None:
        """First allocation of a request whose next `num_external_tokens` a KV connector loads.

        Those blocks are not registered in the prefix cache: their KV arrives
        asynchronously, so another request must not hit them before it is
        there. They are registered by the first `allocate_slots` after the
        load, like any block whose tokens became known.
        """
        return self.allocate_slots(
            request_id,
            token_ids[:num_computed_tokens],
            num_external_tokens,
            num_computed_tokens,
            computed_block_ids,
            num_lookahead_tokens=num_external_tokens,
        )

    def trim(self, request_id: str, num_tokens: int) -> list[int]:
        """Release the request's blocks past the first `num_tokens` tokens (rejected drafts held only
        there). Such blocks were never full of known tokens, so never hashed. Returns their ids."""
        table = self._block_tables.get(request_id)
        num_kept = -(-max(0, num_tokens) // self.block_size)
        if table is None or len(table) <= num_kept:
            return []
        released = table[num_kept:]
        del table[num_kept:]
        for block_id in reversed(released):
            if self._block_hash[block_id] is not None:
                raise RuntimeError(f"request {request_id!r}: block {block_id} past its tokens is hashed")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                self._free_queue.move_to_end(block_id, last=False)
        return released

    def free(self, request_id: str) -> None:
        """Release the request's blocks (no-op for an unknown id). Cached ones stay hit-able until evicted."""
        table = self._block_tables.pop(request_id, None)
        self._request_block_hashes.pop(request_id, None)
        if table is None:
            return
        for block_id in reversed(table):  # tail first: evicted before the shared beginning
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                if self._block_hash[block_id] is None:
                    self._free_queue.move_to_end(block_id, last=False)

    def uncache(self, request_id: str, first_block: int) -> list[int]:
        """The request's blocks from `first_block` on hold no valid KV (the step writing them failed):
        they leave the prefix cache, so no later request hits them. Returns those block ids."""
        table = self._block_tables.get(request_id, [])
        hashes = self._request_block_hashes.get(request_id)
        if hashes is not None:
            del hashes[first_block:]
        for block_id in table[first_block:]:
            block_hash = self._block_hash[block_id]
            if block_hash is not None:
                self._block_hash[block_id] = None
                if self._cached_block_by_hash.get(block_hash) == block_id:
                    del self._cached_block_by_hash[block_hash]
        return table[first_block:]

    def quarantine(self, block_ids: Sequence[int]) -> None:
        """A read that could not be stopped may still write these blocks: keep them (one reference per
        read) out of the free queue and out of the prefix cache."""
        for block_id in block_ids:
            self._take(block_id)
            self._quarantined[block_id] = self._quarantined.get(block_id, 0) + 1
            block_hash = self._block_hash[block_id]
            if block_hash is not None:
                self._block_hash[block_id] = None
                if self._cached_block_by_hash.get(block_hash) == block_id:
                    del self._cached_block_by_hash[block_hash]

    def release_quarantine(self, block_ids: Sequence[int]) -> list[int]:
        """One read into each of these blocks is confirmed ended. Returns those not quarantined
        (ignored)."""
        unknown = []
        for block_id in block_ids:
            count = self._quarantined.get(block_id, 0)
            if count == 0:
                unknown.append(block_id)
                continue
            if count == 1:
                del self._quarantined[block_id]
            else:
                self._quarantined[block_id] = count - 1
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                self._free_queue.move_to_end(block_id, last=False)  # no hash: its content is worthless
        return unknown

    def release_every_quarantine(self) -> None:
        """Every read into a quarantined block has ended (its stage was killed): they all go free."""
        self.release_quarantine([b for b, count in list(self._quarantined.items()) for _ in range(count)])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._cached_block_by_hash.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    # ------------------------------------------------------------------ helpers
    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free_queue[block_id]
        self._ref_counts[block_id] += 1

    def _hash_of_hit(self, block_id: int) -> BlockHash:
        block_hash = self._block_hash[block_id]
        if block_hash is None:
            raise ValueError(f"computed block {block_id} is not a cached block")
        return block_hash

    def _pop_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        block_hash = self._block_hash[block_id]
        if block_hash is not None:  # evict: its content is about to be overwritten
            self._block_hash[block_id] = None
            if self._cached_block_by_hash.get(block_hash) == block_id:
                del self._cached_block_by_hash[block_hash]
        self._ref_counts[block_id] = 1
        return block_id

    def _register_full_blocks(
        self, request_id: str, table: list[int], token_ids: Sequence[int], num_full_blocks: int
    ) -> None:
        hashes = self._request_block_hashes[request_id]
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            block_hash = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(block_hash)
            block_id = table[i]
            # Another request may have filled an identical block first; keep that one as the cached copy.
            if block_hash not in self._cached_block_by_hash and self._block_hash[block_id] is None:
                self._cached_block_by_hash[block_hash] = block_id
                self._block_hash[block_id] = block_hash
