"""float32 logits: the last stage's lm_head sums in float32 and writes float32, whatever the model's dtype.

The logits are not an activation that feeds another layer: the sampler compares
them. bfloat16 keeps 8 bits of mantissa, so near a logit of 30 two values up
to 0.125 apart round to one, and greedy decoding then picks the lower token id
instead of the larger logit (an AMX CPU answered the README's run-command prompt with
"L'Étoile" instead of "Paris" that way). Every head here keeps its weight in
the format it was loaded in and only changes what it writes:

- `NativeLinear` (GGUF blocks or stored floats, `linear_bf16_q` / `linear_bf16`)
  and `KernelLinear` (`linear_bf16` over float weights): the same float32
  sums, stored before the rounding to bfloat16 (no extra work);
- float weights without that kernel (below AVX512-BF16, `linear_kernel =
  "onednn"`): `QLinearHead`, the float32 kernel `qlinear` over the weight in
  its own 16-bit format, on the activations widened to float32 (exact), a
  fixed summation order, so batch and thread invariant like the rest; without
  a C compiler, a float32 copy of the weight and `F.linear`;
- CUDA: `CudaHead`, cuBLAS with float32 output (`torch.mm(out_dtype=...)`),
  or float32 operands where this torch has no such GEMM.

A float32 model's head is left as it is: its logits are float32 already.

On CPU the head writes into rows it keeps from step to step (`ReusedRows`):
49152 float32 logits a row are 12.6 MB at 64 rows, and a fresh tensor every
step page-faulted them in again (1-2 ms a step at 64 rows on the Xeon here,
as much as the float32 width itself costs). A step's logits are read by its
sampling before the next step's head runs, and nothing keeps them longer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncpp.kernels.linear_bf16 import Bf16Linear
from asyncpp.kernels.qlinear import QLinearKernel, qlinear_kernel
from asyncpp.model.native_linear import NativeLinear
from asyncpp.model.packed_linear import KernelLinear

# qlinear's name of a float weight format.
_QLINEAR_FORMATS = {torch.bfloat16: "bf16", torch.float16: "f16"}


class QLinearHead(nn.Module):
    """`[n, in]` 16-bit activations -> `[n, out]` float32 through `qlinear`, the weight kept in its 16-bit format."""

    def __init__(self, weight: torch.Tensor, kernel: QLinearKernel) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.fmt = _QLINEAR_FORMATS[weight.dtype]
        self.packed_weight = kernel.pack(self.fmt, weight.detach(), self.out_features, self.in_features)

    def packed_tensors(self) -> list[torch.Tensor]:
        return [self.packed_weight]

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        return self.kernel.linear(self.fmt, x2, self.packed_weight, self.out_features, out=out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.fmt}, out=float32"


class Float32Head(nn.Module):
    """The fallback without C kernels: a float32 copy of the weight (the rest of that model runs on torch too)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return F.linear(x.float(), self.weight)
        return torch.mm(x.reshape(-1, self.in_features).float(), self.weight.t(), out=out)


class ReusedRows(nn.Module):
    """A CPU head (`forward(x, out=)`, `out_features`) writing float32 logits into rows kept from step
    to step; a step with more rows than ever before allocates them once more."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head
        self._rows: dict[torch.dtype, torch.Tensor] = {}  # by the head's output dtype (a benchmark switches it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.numel() // x.shape[-1]
        dtype = getattr(self.head, "out_dtype", torch.float32)
        rows = self._rows.get(dtype)
        if rows is None or num_rows > rows.shape[0]:
            rows = self._rows[dtype] = torch.empty(num_rows, self.head.out_features, dtype=dtype)
        return self.head(x, out=rows[:num_rows])


class CudaHead(nn.Module):
    """CUDA: the 16-bit GEMM with float32 accumulation and float32 output."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.has_out_dtype = True  # torch.mm(..., out_dtype=): until this torch shows it has none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_out_dtype:
            try:
                return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):
                self.has_out_dtype = False
        return F.linear(x.float(), self.weight.float())


def float32_logits_head(head: nn.Module, bf16_kernel: Bf16Linear | None = None, isa: str | None = None) -> nn.Module:
    """`head` (a loaded lm_head, before `pack_linear_layers`) as a module writing float32 logits.
    `bf16_kernel`: the float-weight bfloat16 kernel where the model uses it; `isa`: qlinear's level."""
    if isinstance(head, (NativeLinear, KernelLinear)):
        head.out_dtype = torch.float32
        return ReusedRows(head)
    if type(head) is not nn.Linear or head.bias is not None:
        raise TypeError(f"no float32-logits form of {type(head).__name__}")
    weight = head.weight
    if weight.dtype == torch.float32:
        return head
    if weight.device.type == "cuda":
        return CudaHead(weight)
    if bf16_kernel is not None and weight.dtype == torch.bfloat16:
        return ReusedRows(KernelLinear(weight, bf16_kernel, out_dtype=torch.float32))
    kernel = qlinear_kernel(isa) if weight.dtype in _QLINEAR_FORMATS else None
    float32_head = QLinearHead(weight, kernel) if kernel is not None else Float32Head(weight)
    return ReusedRows(float32_head)
