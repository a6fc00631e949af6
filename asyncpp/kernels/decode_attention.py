"""Paged decode attention on CPU through the C kernel in `decode_attention.c`.

One query token per row, each attending its own context in a fixed order:
`asyncpp.model.attention` sends every token of a step through it, prefill
tokens included, which is what makes greedy output batch invariant.

`decode_attention_kernel(device, dtype, num_heads, num_kv_heads, head_dim, isa)`
returns a callable, or None when the kernel cannot serve that case here (not
a CPU device, another dtype, a head_dim that is not a multiple of 16, no C
compiler); `asyncpp.model.attention` then keeps its torch path.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

from asyncpp.kernels.build import VEC_DTYPE_CODES, load_kernel_library
from asyncpp.kernels.isa import at_least, native_level

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
             ctypes.c_float, _I64, ctypes.c_int, ctypes.c_int]

DecodeAttention = Callable[..., None]


def decode_attention_kernel(
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    isa: str | None = None,
) -> DecodeAttention | None:
    if torch.device(device).type != "cpu" or not serves(dtype, num_heads, num_kv_heads, head_dim):
        return None
    lib = load_kernel_library("decode_attention", isa or native_level())
    return None if lib is None else wrap_library(lib, dtype)


def serves(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel computes this cache dtype and head shape (else the torch path does)."""
    group = num_heads // num_kv_heads
    shape_ok = head_dim % 16 == 0 and head_dim <= 256 and group * num_kv_heads == num_heads and group <= 16
    return dtype in VEC_DTYPE_CODES and shape_ok


def arithmetic(isa: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, builds: bool) -> str:
    """What a CPU stage's attention multiplies with, in a few words, as `decode_attention.c` dispatches at
    level `isa` (the ready line, `stats()`); `builds`: whether the kernel loads here (else torch's SDPA)."""
    if not builds or not serves(dtype, num_heads, num_kv_heads, head_dim):
        return "torch SDPA"
    if dtype == torch.bfloat16 and at_least(isa, "avx512_bf16") and head_dim % 32 == 0:
        return "vdpbf16ps"
    return "float32 multiplies" if dtype == torch.float32 else "float32 multiplies of widened bfloat16"


def kernel_builds(isa: str) -> bool:
    """Whether the kernel loads at level `isa` here (it is built and cached once)."""
    return load_kernel_library("decode_attention", isa) is not None


def wrap_library(lib: ctypes.CDLL, dtype: torch.dtype) -> DecodeAttention:
    """The callable over a loaded build of `decode_attention.c` (`asyncpp.bench.attention` loads others)."""
    fn = lib.decode_attention
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    dtype_code = VEC_DTYPE_CODES[dtype]

    def decode_attention(
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows may be strided
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] contiguous
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] contiguous
        block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int64 contiguous
        rows: torch.Tensor,  # [num_reqs] int64: token row of each request's query and output
        context_lens: torch.Tensor,  # [num_reqs] int64: keys per request, the new token included
        max_context_len: int,
        block_size: int,
        out: torch.Tensor,  # [num_tokens, num_heads * head_dim] contiguous, written at `rows`
        scale: float,
    ) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode attention needs head-contiguous q and contiguous caches")
        status = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), rows.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), out.stride(0), rows.shape[0], num_heads, k_cache.shape[1], head_dim,
            block_size, scale,
            max_context_len, dtype_code, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode attention kernel failed with status {status}")

    return decode_attention
