"""Allocation of one stage's paged KV cache: a flat (K, V) pair per layer."""

from __future__ import annotations

import torch


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_layers` pairs of `[num_blocks * block_size, num_kv_heads, head_dim]` tensors."""
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]

