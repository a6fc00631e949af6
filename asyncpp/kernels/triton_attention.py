"""Paged decode attention on CUDA through a Triton kernel, the GPU twin of `decode_attention.c`.

Same contract as the C kernel (`asyncpp.kernels.decode_attention`): one
query token per row, each attending its own context `[0, context_len)`
through its block table, in a fixed order. `asyncpp.model.attention` sends
every token of a step through it, prefill tokens included, so a token's
result never depends on what shares its step. The loop over keys runs to
each row's `context_len`, read on the device: the launch has a fixed grid
per batch size, which is what lets a CUDA graph replay it for any context
lengths.

One program per (query row, KV head): it loads the group of query heads that
share the KV head once, walks the row's keys one tile of `keys_per_tile`
(several whole blocks, gathered through the block table) at a time with an
online softmax in float32, and writes the group's outputs. A tile of one
block (16 keys) made each row a chain of short dependent iterations: 24 us a
layer at 64 rows of ~150 keys on an H200 (2026-11-26), most of it latency.
`scripts/attention_tiles.py` times the variants on a GPU. On an H200
(Triton 3.6, graph replays, SmolLM2's 9/3 heads of 64, bfloat16), in us per
layer (2026-11-28, `scripts/gpu_step_check.sh`):

| case | broadcast, 32 keys x 4 warps | `tl.dot`, 64 keys x 4 warps (default) |
| --- | ---: | ---: |
| 1 row of 192 keys | 22.6 | 5.6 |
| 64 rows of 96-224 keys | 32.8 | 8.7 |
| 256 rows of 96-224 keys | 89.5 | 15.0 |
| 256 rows of 400-600 keys | 268.9 | 35.9 |
| a 2048-token prompt chunk | 3465 | 399 |

The broadcast products (`[group, tile, head_dim]` and a reduction over
head_dim) compile to no matrix instruction and their cost grows with the
tile; `tl.dot` pads the query heads of a KV head to 16 rows and runs both
products on the matrix units. The broadcast variant stays for shapes the
dot cannot take (head_dim or tile under 16) and for GPUs before sm_80.

`triton_attention_kernel(device, dtype, ...)` returns the callable, or None
where it cannot run (no Triton, a CPU device). Tests run it on CPU through
Triton's interpreter (`TRITON_INTERPRET=1` set before the kernel is built).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

DecodeAttention = Callable[..., None]


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_attention_kernel(
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    keys_per_tile: int = 64,
    num_warps: int = 4,
    use_dot: bool | None = None,
) -> DecodeAttention | None:
    """The kernel for CUDA devices; for any device under Triton's interpreter (`TRITON_INTERPRET=1`).

    A block size that is not a power of two (Triton's tile sizes must be) gets None. The tile is
    at least one block; both are powers of two, so a tile holds whole blocks. `use_dot`: the scores
    and the weighted sum as `tl.dot` (the query heads of a KV head padded to 16 rows) instead of
    broadcast products and reductions: TF32 matrix units for bfloat16 / float16 caches, whose values
    TF32 holds exactly (the probabilities are rounded to TF32 before the second product), and exact
    float32 for float32 caches. None (the default): the dot wherever it can run (`dot_fits`)."""
    if not has_triton() or num_heads % num_kv_heads != 0 or block_size & (block_size - 1):
        return None
    if torch.device(device).type != "cuda" and not is_interpreted():
        return None
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if keys_per_tile & (keys_per_tile - 1):
        raise ValueError(f"keys_per_tile must be a power of two, got {keys_per_tile}")
    kernel = _build_kernel()
    group = num_heads // num_kv_heads
    tile = max(keys_per_tile, block_size)
    if use_dot is None:
        use_dot = dot_fits(device, head_dim, tile)
    if use_dot and (tile < 16 or pow2(head_dim) < 16):
        raise ValueError(f"use_dot needs tiles and head_dim of at least 16, got {tile} and {head_dim}")
    group_p = max(16, pow2(group)) if use_dot else pow2(group)

    def decode_attention(
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows may be strided
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] contiguous
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] contiguous
        block_table: torch.Tensor,  # [num_rows, max_num_blocks] int64 contiguous
        rows: torch.Tensor,  # [num_rows] int64: token row of each query and its output
        context_lens: torch.Tensor,  # [num_rows] int64: keys per query, itself included
        max_context_len: int,  # unused: each program reads its own length (graph replays)
        block_size: int,
        out: torch.Tensor,  # [num_tokens, num_heads * head_dim] contiguous, written at `rows`
        scale: float,
    ) -> None:
        if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode attention needs head-contiguous q and contiguous caches")
        num_rows = rows.shape[0]
        if num_rows == 0:
            return
        kernel[(num_rows, num_kv_heads)](
            q, q.stride(0), k_cache, v_cache, k_cache.stride(0),
            block_table, block_table.stride(0), rows, context_lens,
            out, out.stride(0), scale,
            GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=pow2(head_dim), BLOCK_SIZE=block_size,
            TILE=tile, USE_DOT=use_dot, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
            num_warps=num_warps,
        )  # fmt: skip

    return decode_attention


def dot_fits(device: torch.device | str, head_dim: int, tile: int) -> bool:
    """`tl.dot` needs 16 rows and columns at least, and matrix units of sm_80 or later (or the interpreter)."""
    if tile < 16 or pow2(head_dim) < 16:
        return False
    if is_interpreted() or torch.device(device).type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def is_interpreted() -> bool:
    """Triton's interpreter runs kernels on the CPU; it is chosen when the kernel is defined."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's block sizes; 1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


_KERNEL = None


def _build_kernel():
    """Compile-on-first-use: importing this module never needs Triton."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_attention(
        q_ptr, q_row_stride, k_ptr, v_ptr, slot_stride,
        table_ptr, table_stride, rows_ptr, lens_ptr,
        out_ptr, out_row_stride, scale,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)  # query row of the launch
        kv_head = tl.program_id(1)
        row = tl.load(rows_ptr + i)
        context_len = tl.load(lens_ptr + i)
        heads = tl.arange(0, GROUP_P)
        dims = tl.arange(0, HEAD_DIM_P)
        head_ok = heads < GROUP
        dim_ok = dims < HEAD_DIM
        q_heads = kv_head * GROUP + heads
        q_offs = row * q_row_stride + q_heads[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

        m = tl.full((GROUP_P,), float("-inf"), tl.float32)
        denom = tl.zeros((GROUP_P,), tl.float32)
        acc = tl.zeros((GROUP_P, HEAD_DIM_P), tl.float32)
        offs = tl.arange(0, TILE)  # key i of a tile: block offs // BLOCK_SIZE of it, slot offs % BLOCK_SIZE
        num_tiles = (context_len + TILE - 1) // TILE
        for t in range(0, num_tiles):
            pos = t * TILE + offs
            key_ok = pos < context_len
            block_ids = tl.load(table_ptr + i * table_stride + pos // BLOCK_SIZE, mask=key_ok, other=0)
            slots = block_ids * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offs = slots[:, None] * slot_stride + kv_head * HEAD_DIM + dims[None, :]
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [TILE, HEAD_DIM_P]
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            if USE_DOT:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [GROUP_P, TILE]
            else:
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P, TILE]
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        result = acc / denom[:, None]
        out_offs = row * out_row_stride + q_heads[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])

    _KERNEL = paged_decode_attention
    return _KERNEL
