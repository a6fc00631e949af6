"""Checks of the Triton decode-attention kernel, run on CUDA in-process or on CPU under Triton's interpreter.

`python -m tests.kernels.triton_attention_checks` (with `TRITON_INTERPRET=1`)
runs every check on CPU and exits non-zero on the first failure; on a GPU
`tests/kernels/test_triton_attention.py` calls the same functions on CUDA.
"""

from __future__ import annotations


import torch

from asyncpp.kernels.triton_attention import triton_attention_kernel
from tests.kernels.test_decode_attention import BLOCK_SIZE, _case, _reference
from tests.kernels.interpreted import main

SHAPES = [(9, 3, 64), (4, 2, 16), (8, 2, 64), (4, 4, 32), (6, 1, 128), (3, 3, 48)]
TOLERANCES = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
CONTEXT_LENS = [1, 15, 16, 17, 32, 100, 203]


def _kernel(device, dtype, num_heads, num_kv_heads, head_dim, keys_per_tile=32, use_dot=None):
    fn = triton_attention_kernel(
        device, dtype, num_heads, num_kv_heads, head_dim, keys_per_tile=keys_per_tile, use_dot=use_dot
    )
    assert fn is not None, "Triton kernel unavailable"
    return fn


def _run(fn, device, q, k_cache, v_cache, block_table, context_lens, rows=None, num_rows=None):
    rows = torch.arange(q.shape[0]) if rows is None else rows
    out = torch.full((num_rows or q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype, device=device)
    scale = q.shape[2] ** -0.5
    on = lambda t: t.to(device)  # noqa: E731
    fn(on(q), on(k_cache), on(v_cache), on(block_table), on(rows), on(context_lens), int(context_lens.max()),
       BLOCK_SIZE, out, scale)  # fmt: skip
    return out.cpu(), scale


def check_matches_float64_reference(device: str) -> None:
    """The broadcast variant (no `tl.dot`: the kernel for shapes and GPUs the dot cannot take), on
    SmolLM2's heads, the widest group and a head_dim that is no power of two."""
    for num_heads, num_kv_heads, head_dim in [(9, 3, 64), (6, 1, 128), (3, 3, 48)]:
        for dtype, atol in TOLERANCES.items():
            fn = _kernel(device, dtype, num_heads, num_kv_heads, head_dim, use_dot=False)
            q, k_cache, v_cache, block_table, context_lens = _case(num_heads, num_kv_heads, head_dim, CONTEXT_LENS, dtype)
            out, scale = _run(fn, device, q, k_cache, v_cache, block_table, context_lens)
            ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale)
            torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


def check_writes_only_the_given_rows(device: str) -> None:
    fn = _kernel(device, torch.float32, 4, 2, 16)
    q, k_cache, v_cache, block_table, context_lens = _case(4, 2, 16, [5, 40], torch.float32)
    q_rows = torch.zeros(5, *q.shape[1:])
    q_rows[1], q_rows[3] = q[0], q[1]
    rows = torch.tensor([1, 3])
    out, scale = _run(fn, device, q_rows, k_cache, v_cache, block_table, context_lens, rows=rows, num_rows=5)
    ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale)
    torch.testing.assert_close(out[rows].double(), ref, atol=2e-6, rtol=2e-6)
    assert out[[0, 2, 4]].isnan().all(), "rows of other tokens must be left alone"


def check_batch_invariant(device: str) -> None:
    """A row's bits do not depend on the rows beside it, for the default kernel (`tl.dot`) and the broadcast one."""
    q, k_cache, v_cache, block_table, context_lens = _case(9, 3, 64, [7, 64, 130, 33, 250, 1], torch.bfloat16)
    for use_dot in (None, False):
        fn = triton_attention_kernel(device, torch.bfloat16, 9, 3, 64, use_dot=use_dot)
        together, _ = _run(fn, device, q, k_cache, v_cache, block_table, context_lens)
        for i in range(q.shape[0]):
            rows = slice(i, i + 1)
            alone, _ = _run(fn, device, q[rows], k_cache, v_cache, block_table[rows], context_lens[rows])
            assert torch.equal(alone[0], together[i]), f"request {i} changed with the batch (use_dot={use_dot})"


def check_every_tile_size(device: str) -> None:
    """A tile of one block (16 keys), of several, and larger than any context here: the same function
    (through `tl.dot`, and at 32 keys through the broadcast products)."""
    for keys_per_tile in (16, 32, 64, 128, 256):
        fn = _kernel(device, torch.float32, 9, 3, 64, keys_per_tile=keys_per_tile, use_dot=keys_per_tile != 32)
        q, k_cache, v_cache, block_table, context_lens = _case(9, 3, 64, CONTEXT_LENS, torch.float32, seed=2)
        out, scale = _run(fn, device, q, k_cache, v_cache, block_table, context_lens)
        ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale)
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def check_dot_variant(device: str) -> None:
    """The default, `tl.dot`: the same function (exact float32; TF32 for bfloat16 caches, which
    rounds the probabilities to TF32 before the second product: within bfloat16's tolerance)."""
    for num_heads, num_kv_heads, head_dim in SHAPES:
        for dtype, atol in TOLERANCES.items():
            fn = _kernel(device, dtype, num_heads, num_kv_heads, head_dim)  # the default: the dot wherever it fits
            q, k_cache, v_cache, block_table, context_lens = _case(num_heads, num_kv_heads, head_dim, CONTEXT_LENS, dtype, seed=3)
            out, scale = _run(fn, device, q, k_cache, v_cache, block_table, context_lens)
            ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale)
            torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


CHECKS = [
    check_matches_float64_reference,
    check_writes_only_the_given_rows,
    check_batch_invariant,
    check_every_tile_size,
    check_dot_variant,
]

if __name__ == "__main__":
    main(CHECKS)
