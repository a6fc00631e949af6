"""Batch-invariant bfloat16 linear layer for small batches on AVX512-BF16 CPUs (`linear_bf16.c`).

`linear_bf16_kernel(device, dtype, isa)` returns a `Bf16Linear`, or None where
it does not apply: not a bfloat16 CPU model, no C compiler, an ISA level
below `avx512_bf16`, or `amx`, where oneDNN's tile kernels are the faster
choice.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from asyncpp.kernels.build import load_kernel_library
from asyncpp.kernels.isa import native_level

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "linear_bf16_supported": ([], _INT),
    "linear_bf16_packed_numel": ([_I64, _I64], _I64),
    "linear_bf16_pack": ([_PTR, _I64, _I64, _PTR], None),
    "linear_bf16": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], None),
}


class Bf16Linear:
    """Packs `[out, in]` weights once, then computes `x @ w.T` for `[rows, in]` inputs."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        packed = weight.new_empty(self._lib.linear_bf16_packed_numel(out_features, in_features))
        self._lib.linear_bf16_pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """`x` `[rows, in]` bfloat16 with a contiguous last dimension -> `[rows, out_features]`."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        y = x.new_empty(rows, out_features)
        self._lib.linear_bf16(
            x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features, in_features,
            y.data_ptr(), out_features, torch.get_num_threads(),
        )  # fmt: skip
        return y


@functools.cache
def _kernel(isa: str) -> Bf16Linear | None:
    lib = load_kernel_library("linear_bf16", isa)
    if lib is None or not lib.linear_bf16_supported():
        return None
    return Bf16Linear(lib)


def linear_bf16_kernel(device: torch.device | str, dtype: torch.dtype, isa: str | None = None) -> Bf16Linear | None:
    """The kernel at level `avx512_bf16` exactly: below it the CPU has no bf16 dot product, and
    with AMX (level `amx`) oneDNN's tile kernels are faster."""
    isa = isa or native_level()
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or isa != "avx512_bf16":
        return None
    return _kernel(isa)
