"""float32 linear layers over weights in their stored format (`qlinear.c`).

The weight stays as the file has it, float32, float16, bfloat16 or GGUF's
Q8_0 / Q4_0 / Q4_1 blocks, repacked once into 16-column panels, and is
dequantized in registers; activations and sums are float32. Every output is
the dot product with the dequantized weight in one fixed order (see the C
header), so a row's result never depends on its batch, its tile, the thread
count or the ISA level (AVX2 and AVX-512 give the same bits; the generic
build rounds its multiply-adds twice).

`qlinear_kernel(isa)` returns a `QLinearKernel` for a level, or None without a
C compiler. `FORMATS` names the formats it serves.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from asyncpp.kernels.build import load_kernel_library
from asyncpp.kernels.huge_pages import weight_buffer
from asyncpp.kernels.isa import native_level

# Format name -> the QL_* code in qlinear.c.
FORMATS = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5}
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")
QK = 32  # inputs per quantized block

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "qlinear_check": ([_INT, _I64], _INT),
    "qlinear_packed_nbytes": ([_INT, _I64, _I64], _I64),
    "qlinear_source_row_bytes": ([_INT, _I64], _I64),
    "qlinear_pack": ([_INT, _PTR, _I64, _I64, _PTR], None),
    "qlinear": ([_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], _INT),
    "qlinear_dequant_rows": ([_INT, _PTR, _I64, _PTR, _I64, _PTR], None),
}


class QLinearKernel:
    """One ISA level's build of the kernel: packs weights, multiplies, looks rows up."""

    dtype = torch.float32  # of the activations and outputs

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib
        self.isa = isa

    def source_row_bytes(self, fmt: str, in_features: int) -> int:
        """Bytes of one `[in_features]` row as GGUF stores it in `fmt`."""
        self._check(fmt, in_features)
        return self._lib.qlinear_source_row_bytes(FORMATS[fmt], in_features)

    def pack(self, fmt: str, rows: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """`rows`: the weight as stored, `[out_features, row_bytes]` uint8 (or a float tensor of
        `[out_features, in_features]` in the format's dtype) -> the packed uint8 weight."""
        self._check(fmt, in_features)
        raw = rows.detach().contiguous().view(torch.uint8).reshape(out_features, -1)
        if raw.shape[1] != self._lib.qlinear_source_row_bytes(FORMATS[fmt], in_features):
            raise ValueError(f"{fmt} rows of {in_features} inputs are not {raw.shape[1]} bytes")
        packed = weight_buffer(self._lib.qlinear_packed_nbytes(FORMATS[fmt], out_features, in_features))
        self._lib.qlinear_pack(FORMATS[fmt], raw.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def linear(
        self, fmt: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x` `[rows, in]` float32 -> `[rows, out_features]` float32 (written into `out`, which may be
        a column slice of a wider tensor, when given)."""
        if x.dtype != torch.float32:
            raise TypeError(f"qlinear takes float32 activations, got {x.dtype}")
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        if out is None:
            out = x.new_empty(rows, out_features)
        elif out.shape != (rows, out_features) or out.stride(1) != 1 or out.dtype != torch.float32:
            raise ValueError(f"out must be [{rows}, {out_features}] float32 with contiguous rows")
        status = self._lib.qlinear(
            FORMATS[fmt], x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features, in_features,
            out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("qlinear: out of memory for the block sums")
        return out

    def dequant_rows(self, fmt: str, packed: torch.Tensor, in_features: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a packed `[out, in_features]` weight, dequantized: `[len(ids), in_features]` float32."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
        self._lib.qlinear_dequant_rows(FORMATS[fmt], packed.data_ptr(), in_features, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def _check(self, fmt: str, in_features: int) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"qlinear has no kernel for weight format {fmt!r}; known: {', '.join(FORMATS)}")
        if self._lib.qlinear_check(FORMATS[fmt], in_features) != 0:
            raise ValueError(f"{fmt} weights need in_features to be a positive multiple of {QK}, got {in_features}")


@functools.cache
def _kernel(isa: str) -> QLinearKernel | None:
    lib = load_kernel_library("qlinear", isa)
    return None if lib is None else QLinearKernel(lib, isa)


def qlinear_kernel(isa: str | None = None) -> QLinearKernel | None:
    """The kernel built for `isa` (None: the CPU's best level), or None without a C compiler."""
    return _kernel(isa or native_level())
