"""Fused bfloat16 CPU ops of the Llama layer (`fused_ops.c`): add + RMSNorm, SiLU * up, RoPE.

`fused_ops(device, dtype)` returns a `FusedOps`, or None where they do not
apply (float32 keeps the torch code the exactness tests rely on; other
devices and machines without a C compiler keep it too).
"""

from __future__ import annotations

import ctypes

import torch

from asyncpp.kernels.build import load_kernel_library
from asyncpp.kernels.isa import native_level

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rms_norm_bf16": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT],
    "silu_mul_bf16": [_PTR, _PTR, _I64, _I64, _INT],
    "rope_bf16": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT],
}
MAX_ROPE_HEAD_DIM = 512


class FusedOps:
    """Each op takes bfloat16 CPU tensors whose last dimension is contiguous."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._lib = lib

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x) * weight, residual + x) for `[num_tokens, hidden]`; no input is modified."""
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        self._lib.add_rms_norm_bf16(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            residual_out.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out, residual_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, 2 * inter]` -> silu(gate) * up `[num_tokens, inter]`."""
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._lib.silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[num_tokens, num_heads, head_dim]` in place; cos/sin `[max_position, head_dim]` float32."""
        num_tokens, num_heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or head_dim > MAX_ROPE_HEAD_DIM:
            raise ValueError(f"rope_: unsupported layout {tuple(x.shape)} / {x.stride()}")
        self._lib.rope_bf16(
            x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            num_tokens, num_heads, head_dim, torch.get_num_threads(),
        )  # fmt: skip
        return x


def fused_ops(device: torch.device | str, dtype: torch.dtype, isa: str | None = None) -> FusedOps | None:
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    lib = load_kernel_library("fused_ops", isa or native_level())
    return None if lib is None else FusedOps(lib)
