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
from asyncpp.kernels.huge_pages import weight_buffer
from asyncpp.kernels.isa import native_level
from asyncpp.kernels.qlinear import BLOCK_FORMATS, FORMATS

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "linear_bf16_supported": ([], _INT),
    "linear_bf16_packed_numel": ([_I64, _I64], _I64),
    "linear_bf16_pack": ([_PTR, _I64, _I64, _PTR], None),
    "linear_bf16": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], None),
    "linear_bf16_f32out": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], None),
    "linear_bf16_q_check": ([_INT, _I64], _INT),
    "linear_bf16_q_packed_nbytes": ([_INT, _I64, _I64], _I64),
    "linear_bf16_q_pack": ([_INT, _PTR, _I64, _I64, _PTR], None),
    "linear_bf16_q": ([_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], _INT),
    "linear_bf16_q_f32out": ([_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], _INT),
    "linear_bf16_q_dequant_rows": ([_INT, _PTR, _I64, _PTR, _I64, _PTR], None),
    "linear_bf16_set_fma_min_rows": ([_I64, _I64], None),
    "linear_bf16_fma_min_rows": ([_INT], _I64),
}
NEVER = 2**63 - 1  # fma_min_rows: no row count takes the float32 FMA path
# GGUF block formats the kernel multiplies in place, by qlinear's codes (linear_bf16.c shares them).
BLOCK_FORMAT_CODES = {fmt: FORMATS[fmt] for fmt in BLOCK_FORMATS}
# Output dtypes: the float32 sums rounded to bfloat16 once (activations), or kept (logits).
OUT_DTYPES = (torch.bfloat16, torch.float32)


class Bf16Linear:
    """Packs `[out, in]` weights once, then computes `x @ w.T` for `[rows, in]` inputs."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib

    @property
    def library(self) -> ctypes.CDLL:
        return self._lib

    def set_fma_min_rows(self, float_rows: int | None, block_rows: int | None) -> None:
        """From how many rows float weights and GGUF blocks take the float32 FMA path (None: never), in
        this process. The path gives the same bits (`bf16_fma.h`), so this changes speed only."""
        self._lib.linear_bf16_set_fma_min_rows(float_rows or 0, block_rows or 0)

    def fma_min_rows(self) -> tuple[int | None, int | None]:
        """(float weights, GGUF blocks): the rows from which each takes the FMA path, None for never."""
        rows = (self._lib.linear_bf16_fma_min_rows(0), self._lib.linear_bf16_fma_min_rows(1))
        return tuple(None if r == NEVER else r for r in rows)  # type: ignore[return-value]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        numel = self._lib.linear_bf16_packed_numel(out_features, in_features)
        packed = weight_buffer(numel * weight.element_size(), weight.dtype)
        self._lib.linear_bf16_pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def pack_blocks(self, fmt: str, rows: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """GGUF rows `[out_features, row_bytes]` uint8 of a block format -> the packed uint8 weight."""
        code = BLOCK_FORMAT_CODES.get(fmt)
        if code is None or self._lib.linear_bf16_q_check(code, in_features) != 0:
            raise ValueError(f"linear_bf16 has no kernel for {fmt} weights of {in_features} inputs")
        rows = rows.detach().contiguous().view(torch.uint8)
        packed = weight_buffer(self._lib.linear_bf16_q_packed_nbytes(code, out_features, in_features))
        self._lib.linear_bf16_q_pack(code, rows.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def linear_blocks(
        self,
        fmt: str,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """`x` `[rows, in]` bfloat16 -> `[rows, out_features]`: the inputs times the exact dequantized
        weight, float32 sums, rounded once to bfloat16 or kept in float32 (`out_dtype`, or `out`'s
        dtype: written into `out`, a column slice maybe, when given)."""
        x, out = _operands(x, out, out_features, out_dtype)
        rows, in_features = x.shape
        entry = self._lib.linear_bf16_q if out.dtype == torch.bfloat16 else self._lib.linear_bf16_q_f32out
        status = entry(
            BLOCK_FORMAT_CODES[fmt], x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features, in_features,
            out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"linear_bf16_q failed with status {status}")
        return out

    def dequant_rows_blocks(self, fmt: str, packed: torch.Tensor, in_features: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a block-packed weight, dequantized to float32 as GGUF defines it."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
        self._lib.linear_bf16_q_dequant_rows(
            BLOCK_FORMAT_CODES[fmt], packed.data_ptr(), in_features, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        return out

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """`x` `[rows, in]` bfloat16 -> `[rows, out_features]` in `out_dtype` (or `out`'s: bfloat16, or
        float32 for the sums unrounded)."""
        x, out = _operands(x, out, out_features, out_dtype)
        rows, in_features = x.shape
        entry = self._lib.linear_bf16 if out.dtype == torch.bfloat16 else self._lib.linear_bf16_f32out
        entry(
            x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features, in_features,
            out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return out


def _operands(
    x: torch.Tensor, out: torch.Tensor | None, out_features: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[rows, in]` with contiguous rows, and `out` checked (or a new `[rows, out_features]` tensor
    of `dtype`): what both linears hand their kernel."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, out_features, dtype=dtype)
    if out.dtype not in OUT_DTYPES or out.shape != (rows, out_features) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {out_features}] bfloat16 or float32 with contiguous rows")
    return x, out


_FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class Bf16NativeKernel:
    """Stored-format weights (`weight_format = "native"`) for bfloat16 activations, with
    `QLinearKernel`'s interface: GGUF blocks multiplied exactly in the kernel (`linear_blocks`),
    float formats rounded to bfloat16 once and packed as usual (the float path's numbers)."""

    dtype = torch.bfloat16

    def __init__(self, kernel: Bf16Linear) -> None:
        self.kernel = kernel

    def pack(self, fmt: str, rows: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        if fmt in BLOCK_FORMAT_CODES:
            return self.kernel.pack_blocks(fmt, rows, out_features, in_features)
        if fmt not in _FLOAT_DTYPES:
            raise ValueError(f"no bfloat16 kernel for weight format {fmt!r}")
        weight = rows.contiguous().view(torch.uint8).view(_FLOAT_DTYPES[fmt]).reshape(out_features, in_features)
        return self.kernel.pack(weight.to(torch.bfloat16))

    def linear(
        self, fmt: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"this kernel takes bfloat16 activations, got {x.dtype}")
        if fmt in BLOCK_FORMAT_CODES:
            return self.kernel.linear_blocks(fmt, x, packed, out_features, out)
        return self.kernel.linear(x, packed, out_features, out)

    def dequant_rows(self, fmt: str, packed: torch.Tensor, in_features: int, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` (for embeddings): GGUF's dequantization, or the bfloat16 values."""
        if fmt in BLOCK_FORMAT_CODES:
            return self.kernel.dequant_rows_blocks(fmt, packed, in_features, ids)
        kpairs = (in_features + 1) // 2  # linear_bf16_pack: [panels][k / 2 pairs][16 lanes][2]
        panels = packed.view(-1, kpairs, 16, 2)
        ids = ids.to(torch.int64)
        return panels[ids // 16, :, ids % 16, :].reshape(len(ids), -1)[:, :in_features].float()


@functools.cache
def bf16_kernel(isa: str) -> Bf16Linear | None:
    """The kernel library built for `isa`, one per process (None: no AVX512-BF16 at `isa`, or no build)."""
    lib = load_kernel_library("linear_bf16", isa)
    if lib is None or not lib.linear_bf16_supported():
        return None
    return Bf16Linear(lib)


def use_fma_min_rows(float_rows: int | None, block_rows: int | None) -> None:
    """This process's bfloat16 linears take float32 FMA from these rows on (the plan's choice); a no-op
    where the kernel does not load."""
    kernel = bf16_kernel("avx512_bf16")
    if kernel is not None:
        kernel.set_fma_min_rows(float_rows, block_rows)


def bf16_native_kernel(isa: str | None = None) -> Bf16NativeKernel | None:
    """The kernel for stored-format weights with bfloat16 activations: any level with AVX512-BF16
    (AMX CPUs have it too), else None."""
    isa = isa or native_level()
    if isa not in ("avx512_bf16", "amx"):
        return None
    kernel = bf16_kernel("avx512_bf16")
    return None if kernel is None else Bf16NativeKernel(kernel)


def linear_bf16_kernel(device: torch.device | str, dtype: torch.dtype, isa: str | None = None) -> Bf16Linear | None:
    """The kernel at level `avx512_bf16` exactly: below it the CPU has no bf16 dot product, and
    with AMX (level `amx`) oneDNN's tile kernels are faster."""
    isa = isa or native_level()
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or isa != "avx512_bf16":
        return None
    return bf16_kernel(isa)
