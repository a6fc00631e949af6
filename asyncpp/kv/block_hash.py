"""Chained content hashes of full KV blocks, the keys of the prefix cache.

`hash_block(parent, token_ids)` is sha256 over the parent block's digest
followed by the block's token ids as little-endian int64. A block's hash
therefore names its whole prefix, not just its own tokens: the same tokens
after a different prefix get a different hash (their KV differs).

sha256 rather than Python's `hash`: it is stable across processes and
machines, and collisions cannot be crafted by a client to read another
request's KV. Cost is one digest per `block_size` tokens.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BlockHash = bytes  # 32-byte sha256 digest

_ROOT_PARENT: BlockHash = b""  # parent of the first block of every sequence


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256((parent or _ROOT_PARENT) + payload).digest()

