"""How many KV blocks fit a memory budget.

A block holds, for every layer of the stage, one K and one V tensor of
`[block_size, num_kv_heads, head_dim]`. Each stage sizes its own cache for its
own layers; the engine uses the minimum over stages, since block ids are
shared by all of them.
"""

from __future__ import annotations


def kv_bytes_per_block(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_size_bytes: int) -> int:
    for name, value in (
        ("block_size", block_size),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_size_bytes", dtype_size_bytes),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_size_bytes  # 2: K and V


def num_blocks_for_budget(
    budget_bytes: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_size_bytes: int
) -> int:
    """Whole blocks that fit in `budget_bytes` (0 when not even one does; the caller decides if that is an error)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // kv_bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype_size_bytes)
