"""`paged_attention` on a mixed step (fresh prefills, a later chunk, decodes) against dense float64 attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncpp.kernels.decode_attention import decode_attention_kernel
from asyncpp.model.attention import AttentionMetadata, paged_attention

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def _dense_reference(q, k_all, v_all, start, num_new, scale):
    """Causal attention of `num_new` queries at positions start.. over keys 0..start+num_new-1."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k_all.double().repeat_interleave(group, dim=1)  # [ctx, heads, dim]
    v = v_all.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(start, start + num_new)[:, None]
    scores = scores.masked_fill(torch.arange(len(k))[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(num_new, -1)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_mixed_step_matches_dense_attention(use_kernel):
    kernel = decode_attention_kernel("cpu", torch.float32, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM) if use_kernel else None
    if use_kernel and kernel is None:
        pytest.skip("decode kernel unavailable")
    g = torch.Generator().manual_seed(0)
    # fresh prefill, decode, later prefill chunk (after 20 cached tokens), fresh prefill, decode
    start_positions = np.array([0, 30, 20, 0, 5])
    num_new_tokens = np.array([12, 1, 9, 33, 1])
    num_reqs = len(start_positions)
    block_table = np.arange(num_reqs * 4).reshape(num_reqs, 4)[::-1].copy()  # disjoint, scattered blocks
    cache_shape = (num_reqs * 4 * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape, generator=g), torch.randn(cache_shape, generator=g)
    num_tokens = int(num_new_tokens.sum())
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g)
    meta, positions = AttentionMetadata.build(
        start_positions, num_new_tokens, block_table, BLOCK_SIZE, "cpu", torch.float32, decode_kernel=kernel
    )
    assert meta.fresh_prefills == [(0, 12), (22, 55)]
    assert (meta.kernel_decode is not None) == use_kernel
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    row = 0
    for i, (start, n) in enumerate(zip(start_positions, num_new_tokens)):
        pos = torch.arange(start + n)
        slots = torch.from_numpy(block_table[i])[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        # After the call the cache holds the old context plus this step's keys and values.
        assert torch.equal(k_cache[slots[start:]], k[row : row + n])
        ref = _dense_reference(q[row : row + n], k_cache[slots], v_cache[slots], start, n, scale)
        torch.testing.assert_close(out[row : row + n].double(), ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.from_numpy(positions[row : row + n]), pos[start:])
        row += n
