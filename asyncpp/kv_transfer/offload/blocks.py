"""Copy whole KV blocks between a stage's paged cache and a contiguous payload.

A stage's cache is one `(K, V)` pair per layer, each `[num_blocks *
block_size, num_kv_heads, head_dim]`; block `b` is rows `b * block_size` to
`(b + 1) * block_size`. A payload is `[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]` (2: K then V), one record per block. Both
directions are vectorised per layer (`index_select` / `index_copy_` over a
block view), never a Python loop over blocks.
"""

from __future__ import annotations

import torch


def _block_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    if cache.shape[0] % block_size:
        raise ValueError(f"a cache of {cache.shape[0]} rows is not whole blocks of {block_size}")
    return cache.view(cache.shape[0] // block_size, block_size, *cache.shape[1:])


def gather_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], block_size: int) -> torch.Tensor:
    """A new contiguous `[len(block_ids), num_layers, 2, block_size, heads, dim]` copy of those blocks."""
    if not kv_caches:
        raise ValueError("no KV caches")
    k0 = kv_caches[0][0]
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    out = torch.empty((len(block_ids), len(kv_caches), 2, block_size, *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        out[:, layer, 0].copy_(_block_view(k, block_size).index_select(0, index))
        out[:, layer, 1].copy_(_block_view(v, block_size).index_select(0, index))
    return out


def scatter_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], block_size: int, payload: torch.Tensor
) -> None:
    """Write `payload` (as `gather_blocks` returns it) into those blocks of the cache, in place."""
    if not kv_caches:
        raise ValueError("no KV caches")
    k0 = kv_caches[0][0]
    expected = (len(block_ids), len(kv_caches), 2, block_size, *k0.shape[1:])
    if tuple(payload.shape) != expected:
        raise ValueError(f"payload shape {tuple(payload.shape)}, expected {expected}")
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    payload = payload.to(dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        _block_view(k, block_size).index_copy_(0, index, payload[:, layer, 0])
        _block_view(v, block_size).index_copy_(0, index, payload[:, layer, 1])
