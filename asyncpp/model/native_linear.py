"""Linear layers and embeddings over weights in their stored format.

`NativeLinear` owns its weight in the source's format (GGUF Q4_1 blocks,
float16, float32, ...; `asyncpp.weights.base.StoredTensor`) packed for its
kernel, and multiplies activations of the kernel's dtype with it: float32
through `asyncpp.kernels.qlinear`, bfloat16 (on CPUs with AVX512-BF16)
through `asyncpp.kernels.linear_bf16`'s block variant (bfloat16 inputs times
the file's exact weights). A layer made of several source tensors (q/k/v,
gate/up) keeps one packed weight per run of parts of the same format and
writes each run's outputs into its columns of one output tensor, so a file
that stores v in Q8_0 and q/k in Q4_1 still needs no float copy.

`NativeEmbedding` looks token rows up in a packed weight, dequantized exactly as
GGUF defines it; a tied model's embedding and lm_head share one packed weight.

`NativeWeights` builds both for one model slice and packs each source tensor
once (the tied embedding/head is the same `StoredTensor` object).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from asyncpp.kernels.layer_stack import StackableLinear
from asyncpp.weights.base import StoredTensor


class NativeKernel(Protocol):
    """What a native module needs of its kernel (`QLinearKernel`, `Bf16NativeKernel`)."""

    dtype: torch.dtype  # of activations and outputs

    def pack(self, fmt: str, rows: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor: ...

    def linear(
        self, fmt: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x @ w.T` into `out` when given: the kernel's dtype, or float32 (the sums unrounded)."""
        ...

    def dequant_rows(self, fmt: str, packed: torch.Tensor, in_features: int, ids: torch.Tensor) -> torch.Tensor: ...


class NativeLinear(nn.Module, StackableLinear):
    """A bias-free linear layer: `[..., in]` -> `[..., out]` in the kernel's dtype (one the layer stack can run),
    or in `out_dtype` = float32 where set (a model's logits: `asyncpp.model.logits_head`)."""

    def __init__(self, runs: list[tuple[str, torch.Tensor, int]], in_features: int, kernel: NativeKernel) -> None:
        """`runs`: (format, packed weight, out_features) per run of output columns, in order."""
        super().__init__()
        self.runs = runs
        self.in_features = in_features
        self.out_features = sum(n for _, _, n in runs)
        self.kernel = kernel
        self.out_dtype = kernel.dtype

    def packed_tensors(self) -> list[torch.Tensor]:
        return [packed for _, packed, _ in self.runs]

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: `[rows, out_features]` of `out_dtype` to write into (reused logits rows); else a new tensor."""
        x2 = x.reshape(-1, self.in_features)
        y = x2.new_empty(x2.shape[0], self.out_features, dtype=self.out_dtype) if out is None else out
        col = 0
        for fmt, packed, n in self.runs:
            self.kernel.linear(fmt, x2, packed, n, out=y[:, col : col + n])
            col += n
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        formats = "+".join(f"{fmt}[{n}]" for fmt, _, n in self.runs)
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={formats}"


class NativeEmbedding(nn.Module):
    """Token ids `[num_tokens]` -> rows `[num_tokens, hidden]` of a packed weight, in the kernel's dtype."""

    def __init__(self, fmt: str, packed: torch.Tensor, vocab_size: int, hidden_size: int, kernel: NativeKernel) -> None:
        super().__init__()
        self.fmt, self.packed, self.kernel = fmt, packed, kernel
        self.num_embeddings, self.embedding_dim = vocab_size, hidden_size

    def packed_tensors(self) -> list[torch.Tensor]:
        return [self.packed]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = self.kernel.dequant_rows(self.fmt, self.packed, self.embedding_dim, ids.reshape(-1))
        return rows.to(self.kernel.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weights={self.fmt}"


class NativeWeights:
    """Builds the native modules of one model slice; each source tensor is packed once."""

    def __init__(self, kernel: NativeKernel) -> None:
        self.kernel = kernel
        self._packed: dict[int, torch.Tensor] = {}  # id(StoredTensor) -> packed, for tied weights

    def linear(self, parts: list[StoredTensor]) -> NativeLinear:
        """One layer from source tensors stacked by output rows (q, k, v -> qkv)."""
        in_features = parts[0].shape[1]
        if any(p.shape[1] != in_features for p in parts):
            raise ValueError(f"parts {[p.name for p in parts]} have different input sizes")
        runs: list[tuple[str, torch.Tensor, int]] = []
        i = 0
        while i < len(parts):
            j = i
            while j < len(parts) and parts[j].format == parts[i].format:
                j += 1
            run = parts[i:j]
            n = sum(p.shape[0] for p in run)
            if len(run) == 1:
                packed = self._pack(run[0])
            else:
                packed = self.kernel.pack(run[0].format, torch.cat([p.rows for p in run]), n, in_features)
            runs.append((parts[i].format, packed, n))
            i = j
        return NativeLinear(runs, in_features, self.kernel)

    def embedding(self, weight: StoredTensor) -> NativeEmbedding:
        vocab_size, hidden_size = weight.shape
        return NativeEmbedding(weight.format, self._pack(weight), vocab_size, hidden_size, self.kernel)

    def _pack(self, weight: StoredTensor) -> torch.Tensor:
        key = id(weight)
        if key not in self._packed:
            self._packed[key] = self.kernel.pack(weight.format, weight.rows, *weight.shape)
        return self._packed[key]
