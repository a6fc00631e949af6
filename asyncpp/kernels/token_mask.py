"""A grammar's token bitmask applied to logits rows in place, on CPU (`token_mask.c`).

`apply_token_bitmask(logits, bitmask)`: `logits` [rows, vocab] float32 or bfloat16, `bitmask`
[rows, words] int32 as llguidance fills it (bit j of word w: token 32w + j allowed); every token
a row's mask forbids, and any past its words, becomes -inf. The same result as
`logits.masked_fill_(~allowed, -inf)` with the bits unpacked (the torch fallback: other devices
and dtypes, machines without a C compiler), at a fraction of the cost: torch's masked_fill takes
about 15 ms for 64 rows of 49152 logits on one core here.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from asyncpp.kernels.build import VEC_DTYPE_CODES, load_kernel_library
from asyncpp.kernels.isa import native_level

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    lib = load_kernel_library("token_mask", isa)
    if lib is not None:
        lib.apply_token_bitmask.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _INT]
        lib.apply_token_bitmask.restype = None
    return lib


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, isa: str | None = None) -> None:
    """Mask `logits` ([rows, vocab]) in place with `bitmask` ([rows, words] int32): the C kernel for CPU
    logits with a unit column stride and a contiguous bitmask, else torch on the logits' device."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0] or bitmask.dtype != torch.int32:
        raise ValueError(f"logits {list(logits.shape)} and an int32 bitmask of as many rows, got {list(bitmask.shape)} {bitmask.dtype}")
    dtype = VEC_DTYPE_CODES.get(logits.dtype)
    lib = _library(isa or native_level()) if logits.device.type == "cpu" and dtype is not None else None
    if lib is None or logits.stride(1) != 1 or not bitmask.is_contiguous():
        logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]).to(logits.device), float("-inf"))
        return
    rows, vocab = logits.shape
    row_bytes = logits.stride(0) * logits.element_size()
    lib.apply_token_bitmask(logits.data_ptr(), row_bytes, rows, vocab, bitmask.data_ptr(), bitmask.shape[1], dtype)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool: allowed tokens (none past the words), on the bitmask's
    device (a CUDA step's masks are unpacked there, not copied over 32 times wider)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts).bitwise_and_(1).flatten(1).bool()
    allowed = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool, device=bitmask.device)
    n = min(vocab, bits.shape[1])
    allowed[:, :n] = bits[:, :n]
    return allowed
