"""Config dtype names <-> torch dtypes, in one place (model, KV cache and activation rings agree)."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


# A ring also carries token ids (`asyncpp.transport.token_ring`), besides the model's activations.
RING_DTYPES: dict[str, torch.dtype] = {**TORCH_DTYPES, "int64": torch.int64}


def ring_dtype(name: str) -> torch.dtype:
    if name not in RING_DTYPES:
        raise ValueError(f"unknown ring dtype {name!r}; known: {sorted(RING_DTYPES)}")
    return RING_DTYPES[name]
