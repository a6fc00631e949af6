"""Allocation of one stage's paged KV cache: a flat (K, V) pair per layer.

On CPU each tensor is a huge-page-advised mapping of its own (`kernels.huge_pages.zeros`): a decode
step reads its requests' blocks scattered over every layer's cache, and on 4 KB pages the page walks
cost the attention kernel about 10% (19 layers, 32 requests at contexts 67-131, Zen 4). Its pages
are faulted in here, at start-up, as `torch.zeros` did: on a fresh VM the first touch of a huge page
cost about 6 ms, which a new server's first prompts paid in their steps.
"""

from __future__ import annotations

import torch

from asyncpp.kernels import huge_pages


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
    if torch.device(device).type == "cpu":
        return [(huge_pages.zeros(shape, dtype), huge_pages.zeros(shape, dtype)) for _ in range(num_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]

