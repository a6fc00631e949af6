"""Fused ops of the Llama layer: add + RMSNorm, SiLU * up, RoPE, one kernel each.

`FusedOps` is what the model calls (`LlamaModel.use_fused_ops`). On CPU they
are C (`fused_ops.c`, `CFusedOps`), in bfloat16 or float32; on CUDA Triton
kernels (`asyncpp.kernels.triton_fused`), in float32, bfloat16 or float16.
`fused_ops(device, dtype)` returns the ops for one activation dtype, or None
where they do not apply (CPU float16, other devices, machines without a C
compiler or without Triton keep the torch code). Narrow-dtype ops round like
the torch code; float32 ops are bit-identical to torch for the residual add
and RoPE, and within float32 rounding of it for the norm and SiLU (see
`fused_ops.c`, `triton_fused.py`).
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from asyncpp.kernels.build import load_kernel_library
from asyncpp.kernels.isa import native_level
from asyncpp.kernels.triton_fused import check_dtypes, triton_fused_ops

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rms_norm": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT],
    "silu_mul": [_PTR, _PTR, _I64, _I64, _INT],
    "rope": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT],
}
_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}  # the C functions are <op>_<suffix>
MAX_ROPE_HEAD_DIM = 512


class FusedOps(Protocol):
    """The ops the model swaps in for its torch code, for tensors of `dtype` on one device."""

    dtype: torch.dtype
    # Whether the ops have `rope_write_kv_` (RoPE and the KV-cache write in one launch: the Triton ops).
    fuses_kv_write: bool

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x) * weight, residual + x) as new tensors; no input is modified."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, 2 * inter]` -> silu(gate) * up `[num_tokens, inter]`."""
        ...

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[num_tokens, num_heads, head_dim]` (rows may be strided) in place and return it."""
        ...


class CFusedOps:
    """The C ops (`FusedOps`). Each op takes CPU tensors of `dtype` whose last dimension is contiguous (cos/sin: float32)."""

    fuses_kv_write = False  # on CPU the layer stack (`layer_stack.c`) runs RoPE and the write in one call anyway

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        fns = []
        for op, argtypes in _SIGNATURES.items():
            fn = getattr(lib, f"{op}_{_SUFFIXES[dtype]}")
            fn.argtypes, fn.restype = argtypes, None
            fns.append(fn)
        self._add_rms_norm, self._silu_mul, self._rope = fns

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x) * weight, residual + x) for `[num_tokens, hidden]`; no input is modified."""
        self._check(x, weight, x if residual is None else residual)
        x, weight = x.contiguous(), weight.contiguous()  # kept alive by name through the call
        residual = None if residual is None else residual.contiguous()
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        self._add_rms_norm(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            residual_out.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out, residual_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, 2 * inter]` -> silu(gate) * up `[num_tokens, inter]`."""
        self._check(gate_up)
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[num_tokens, num_heads, head_dim]` in place; cos/sin `[max_position, head_dim]` float32."""
        self._check(x)
        num_tokens, num_heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or head_dim > MAX_ROPE_HEAD_DIM or head_dim % 2:
            raise ValueError(f"rope_: unsupported layout {tuple(x.shape)} / {x.stride()}")
        if positions.dtype != torch.int64 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise TypeError(f"rope_: positions must be int64 and cos/sin float32, got {positions.dtype}, {cos.dtype}")
        positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
        self._rope(
            x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            num_tokens, num_heads, head_dim, torch.get_num_threads(),
        )  # fmt: skip
        return x

    def _check(self, *tensors: torch.Tensor) -> None:
        check_dtypes(self.dtype, tensors)


def fused_ops(device: torch.device | str, dtype: torch.dtype, isa: str | None = None) -> FusedOps | None:
    """The C ops on CPU (`isa`: the build level), the Triton ops on CUDA; None where neither applies."""
    if torch.device(device).type == "cuda":
        return triton_fused_ops(device, dtype)
    if torch.device(device).type != "cpu" or dtype not in _SUFFIXES:
        return None
    lib = load_kernel_library("fused_ops", isa or native_level())
    return None if lib is None else CFusedOps(lib, dtype)
