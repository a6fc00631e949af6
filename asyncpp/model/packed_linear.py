"""Prepacked weights for the bfloat16 linear layers of a CPU model.

Two backends, chosen once per model (`model.linear_kernel`):

- `KernelLinear`: asyncpp's AVX512-BF16 kernel (`asyncpp/kernels/linear_bf16.c`),
  used by default where the CPU has AVX512-BF16 and no AMX. It overlaps the
  weight stream with the arithmetic on decode-sized batches: 1.4-1.6x faster
  than oneDNN at 16-32 rows, on a par from 128 rows. Every output is one
  float32 sum in a fixed order, so it is batch invariant by construction.
- `PackedLinear`: oneDNN's packed layout (AMX machines, and the fallback).

`F.linear` on a bfloat16 CPU tensor reorders the weight into oneDNN's blocked
layout on every call. Packing each weight once, after loading, skips that
copy: 1.3-1.7x faster on decode-sized matmuls on the AMX machines here.

Batch invariance: a token's output must not depend on which other tokens
share its step (pp size, cohorts and batching would change greedy output).
oneDNN computes every row of a batch of two or more rows the same way, but a
single row takes a matrix-vector path that sums in another order (on the
AMD machines here, ~8% of `down_proj` rows differ by a rounding step), so a
one-row input is computed as a two-row batch. Tested in
`tests/model/test_packed_linear.py`. float32 models and other devices keep
plain `nn.Linear`, whose kernels the exactness tests against `transformers`
rely on.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncpp.kernels.linear_bf16 import Bf16Linear

# oneDNN picks its blocking from an expected batch; decode batches are this order of size.
BATCH_SIZE_HINT = 64


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight lives only in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, batch_size_hint: int = BATCH_SIZE_HINT) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A plain attribute, not a parameter: packed tensors take no part in `.to()` or state dicts.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)

    def packed_tensors(self) -> list[torch.Tensor]:
        return [self.packed_weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:  # the single-row path rounds differently: see the module doc
            return self._linear(x.expand(2, -1))[:1]
        return self._linear(x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


class KernelLinear(nn.Module):
    """A bias-free linear layer computed by asyncpp's `linear_bf16` kernel on its packed weight."""

    def __init__(self, weight: torch.Tensor, kernel: Bf16Linear, out_dtype: torch.dtype = torch.bfloat16) -> None:
        """`out_dtype`: bfloat16 (activations), or float32 for the sums unrounded (logits)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.out_dtype = out_dtype
        self.packed_weight = kernel.pack(weight)  # a plain attribute, as in PackedLinear

    def packed_tensors(self) -> list[torch.Tensor]:
        return [self.packed_weight]

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: `[rows, out_features]` of `out_dtype` to write into (reused logits rows); else a new tensor."""
        x2 = x.reshape(-1, self.in_features)
        y = self.kernel.linear(x2, self.packed_weight, self.out_features, out=out, out_dtype=self.out_dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=linear_bf16"


def pack_linear_layers(model: nn.Module, kernel: Bf16Linear | None = None) -> int:
    """Replace every bias-free `nn.Linear` of `model` by a `KernelLinear` (with `kernel`) or
    a `PackedLinear`; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.bias is None
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight) if kernel is None else KernelLinear(child.weight, kernel))
    return len(targets)
