"""Source registry and the two public entry points, `read_arch` and `load_weights`.

Contract:
- `read_arch(source, path_or_name)` reads metadata only.
- `load_weights(...)` returns float32, contiguous CPU tensors keyed by HF
  Llama names, for layers in [start_layer, end_layer) only (global indices),
  plus `model.embed_tokens.weight` if `need_embed`, plus `model.norm.weight`
  and `lm_head.weight` if `need_head`. With tied embeddings `lm_head.weight`
  is the embedding tensor read from the source (the very same tensor object
  as `model.embed_tokens.weight` when both are requested).
- Every returned tensor's shape is checked against the architecture here, so
  a loader bug or a mismatched file fails loudly at load time.

New sources are added with `register_loader`, not by editing callers.
"""

from __future__ import annotations

import torch

from asyncpp.model.arch import ModelArch
from asyncpp.weights.base import (
    EMBED_NAME,
    LM_HEAD_NAME,
    StoredTensor,
    WeightLoader,
    expected_shape,
    stored_names,
)
from asyncpp.weights.gguf_loader import GgufLoader
from asyncpp.weights.hf_loader import HfLoader
from asyncpp.weights.random_loader import RandomLoader

_LOADERS: dict[str, WeightLoader] = {
    "gguf": GgufLoader(),
    "hf": HfLoader(),
    "random": RandomLoader(),
}


def register_loader(source: str, loader: WeightLoader) -> None:
    if source in _LOADERS:
        raise ValueError(f"weight source {source!r} is already registered")
    _LOADERS[source] = loader


def known_sources() -> list[str]:
    return sorted(_LOADERS)


def get_loader(source: str) -> WeightLoader:
    loader = _LOADERS.get(source)
    if loader is None:
        raise ValueError(f"unknown weight source {source!r}; known sources: {known_sources()}")
    return loader


def read_arch(source: str, path_or_name: str | None) -> ModelArch:
    return get_loader(source).read_arch(path_or_name)


def stored_bytes(source: str, path_or_name: str | None) -> int | None:
    """The bytes of the source's stored weight tensors, for sources that can tell without loading them
    (a GGUF file's tensors in their own formats); else None."""
    loader = get_loader(source)
    return loader.stored_bytes(path_or_name) if hasattr(loader, "stored_bytes") else None


def load_weights(
    source: str,
    path_or_name: str | None,
    *,
    start_layer: int,
    end_layer: int,
    need_embed: bool,
    need_head: bool,
    native: bool = False,
) -> dict[str, torch.Tensor | StoredTensor]:
    """`native`: 2-D weights come as `StoredTensor`s in the source's own format (sources that only
    hold floats, and loaders without `load_stored`, give them as `f32`)."""
    loader = get_loader(source)
    arch = loader.read_arch(path_or_name)
    names = stored_names(arch, start_layer, end_layer, need_embed, need_head)
    if native and hasattr(loader, "load_stored"):
        tensors = loader.load_stored(path_or_name, arch, names)
    else:
        tensors = loader.load(path_or_name, arch, names)
        if native:
            tensors = StoredTensor.from_floats(tensors)
    _check(arch, names, tensors)
    if need_head and arch.tie_word_embeddings:
        tensors[LM_HEAD_NAME] = tensors[EMBED_NAME]
        if not need_embed:
            del tensors[EMBED_NAME]
    return tensors


def _check(arch: ModelArch, names: list[str], tensors: dict[str, torch.Tensor]) -> None:
    if set(tensors) != set(names):
        raise RuntimeError(
            f"loader returned {sorted(set(tensors) ^ set(names))} contrary to the request"
        )
    for name in names:
        tensor, shape = tensors[name], expected_shape(arch, name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        if isinstance(tensor, StoredTensor):
            continue
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise RuntimeError(f"loader returned {name!r} as {tensor.dtype} on {tensor.device}")
