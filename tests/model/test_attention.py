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
    # With the kernel every token is a decode-style query; without it, fresh prompts get their own SDPA.
    assert meta.fresh_prefills == ([] if use_kernel else [(0, 12), (22, 55)])
    assert (meta.kernel_rows is not None) == use_kernel
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


def test_kernel_result_does_not_depend_on_chunking_caching_or_batch():
    """bfloat16: a prompt's attention output is bit-identical whether it is computed as one fresh
    prefill, as a chunk after a cached prefix, token by token as decodes, or next to other requests."""
    dtype, heads, kv_heads, head_dim = torch.bfloat16, 9, 3, 64
    kernel = decode_attention_kernel("cpu", dtype, heads, kv_heads, head_dim)
    if kernel is None:
        pytest.skip("decode kernel unavailable")
    g = torch.Generator().manual_seed(3)
    length, num_blocks = 40, 16
    q = torch.randn(length, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
    other = [t.flip(0) for t in (q, k, v)]  # a second request, placed before ours in a shared step
    table = np.array([[5, 2, 7, 0]])
    other_table = np.array([[9, 11, 3, 1]])
    cache_shape = (num_blocks * BLOCK_SIZE, kv_heads, head_dim)

    def run(chunks: list[tuple[int, int]], with_other: bool = False) -> torch.Tensor:
        """Compute our prompt in (start, end) chunks, one step each; the rows of our tokens."""
        k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
        outs = []
        for start, end in chunks:
            parts = [(t[start:end] for t in (q, k, v))]
            starts, lens, tables = [start], [end - start], [table]
            if with_other:
                parts.insert(0, (t[start:end] for t in other))
                starts, lens, tables = [start] + starts, [end - start] + lens, [other_table] + tables
            qs, ks, vs = (torch.cat(ts) for ts in zip(*parts))
            meta, _ = AttentionMetadata.build(
                np.array(starts), np.array(lens), np.concatenate(tables), BLOCK_SIZE, "cpu", dtype, kernel
            )
            out = paged_attention(qs, ks, vs, k_cache, v_cache, meta, head_dim**-0.5)
            outs.append(out[-(end - start) :])
        return torch.cat(outs)

    fresh = run([(0, length)])
    assert torch.equal(run([(0, 16), (16, length)]), fresh)  # a chunk after a cached 16-token prefix
    assert torch.equal(run([(0, 23), (23, length)]), fresh)  # a chunk that starts mid-block
    assert torch.equal(run([(0, 1)] + [(i, i + 1) for i in range(1, length)]), fresh)  # token by token
    assert torch.equal(run([(0, 16), (16, length)], with_other=True), fresh)
