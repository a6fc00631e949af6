"""The loader protocol and the HF tensor naming every loader speaks.

Contract: a `WeightLoader` turns one kind of source (a GGUF file, an HF
directory, a named random config) into a `ModelArch` and into float32 CPU
tensors keyed by HF Llama parameter names. Loaders only fetch the names they
are asked for: the registry (`registry.py`) decides which names a pipeline
stage needs, so a stage never reads or dequantizes another stage's layers.

Layer indices in names are global: layer 5 is `model.layers.5.*` whichever
slice asked for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncpp.model.arch import ModelArch

EMBED_NAME = "model.embed_tokens.weight"
NORM_NAME = "model.norm.weight"
LM_HEAD_NAME = "lm_head.weight"

# Per-layer parameter suffixes, in the order the model declares them.
LAYER_SUFFIXES: tuple[str, ...] = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


# Formats a stored weight may have (asyncpp.kernels.qlinear serves each).
STORED_FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")


@dataclass(frozen=True)
class StoredTensor:
    """A 2-D weight in its source's own format (`weight_format = "native"`).

    `rows` is `[out_features, row_bytes]` uint8, each row laid out as the file
    stores it (GGUF blocks of 32 inputs for the quantized formats), so rows can
    be reordered and concatenated but never dequantized here. `name` is the
    source's tensor name, for error messages.
    """

    format: str
    rows: torch.Tensor  # [out_features, row_bytes] uint8
    shape: tuple[int, int]  # (out_features, in_features)
    name: str

    @staticmethod
    def from_float(weight: torch.Tensor, name: str) -> "StoredTensor":
        """A float32 weight as an `f32` stored tensor (sources that hold floats)."""
        weight = weight.detach().to(torch.float32).contiguous()
        return StoredTensor("f32", weight.view(torch.uint8), tuple(weight.shape), name)

    @staticmethod
    def from_floats(tensors: dict[str, torch.Tensor]) -> dict[str, "torch.Tensor | StoredTensor"]:
        """`tensors` with every 2-D float tensor as an `f32` stored tensor; 1-D ones (norms) as they are.
        One tensor under two names (a tied head) stays one stored tensor, so it is packed once."""
        stored: dict[int, StoredTensor] = {}
        out: dict[str, torch.Tensor | StoredTensor] = {}
        for name, t in tensors.items():
            if t.dim() != 2:
                out[name] = t
            elif id(t) in stored:
                out[name] = stored[id(t)]
            else:
                out[name] = stored[id(t)] = StoredTensor.from_float(t, name)
        return out

    def select_rows(self, order: torch.Tensor) -> "StoredTensor":
        return StoredTensor(self.format, self.rows[order].contiguous(), self.shape, self.name)

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


class WeightLoader(Protocol):
    """One source kind. `path_or_name` is whatever locates the source."""

    def read_arch(self, path_or_name: str | None) -> ModelArch:
        """Reads metadata only; never touches tensor data."""
        ...

    def load(
        self, path_or_name: str | None, arch: ModelArch, names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Returns exactly `names` as float32 CPU tensors in HF layout."""
        ...


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def layer_names(layer: int) -> list[str]:
    return [layer_prefix(layer) + suffix for suffix in LAYER_SUFFIXES]


def split_layer_name(name: str) -> tuple[int, str] | None:
    """`model.layers.3.mlp.up_proj.weight` -> (3, "mlp.up_proj.weight"); None if not a layer name."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]), parts[3]
    return None


def full_model_names(arch: ModelArch) -> list[str]:
    """Every parameter of the full model; `lm_head.weight` only when untied."""
    names = [EMBED_NAME]
    for layer in range(arch.num_layers):
        names += layer_names(layer)
    names.append(NORM_NAME)
    if not arch.tie_word_embeddings:
        names.append(LM_HEAD_NAME)
    return names


def stored_names(
    arch: ModelArch, start_layer: int, end_layer: int, need_embed: bool, need_head: bool
) -> list[str]:
    """Names to read from the source for one pipeline slice.

    A tied head is the embedding tensor, so it is read under `EMBED_NAME`;
    the registry then hands it out under `LM_HEAD_NAME` as well.
    """
    if not 0 <= start_layer <= end_layer <= arch.num_layers:
        raise ValueError(
            f"layer slice [{start_layer}, {end_layer}) is not within [0, {arch.num_layers})"
        )
    names: list[str] = []
    if need_embed or (need_head and arch.tie_word_embeddings):
        names.append(EMBED_NAME)
    for layer in range(start_layer, end_layer):
        names += layer_names(layer)
    if need_head:
        names.append(NORM_NAME)
        if not arch.tie_word_embeddings:
            names.append(LM_HEAD_NAME)
    return names


def expected_shape(arch: ModelArch, name: str) -> tuple[int, ...]:
    """The HF shape of parameter `name` ([out_features, in_features] for linears)."""
    if name in (EMBED_NAME, LM_HEAD_NAME):
        return (arch.vocab_size, arch.hidden_size)
    if name == NORM_NAME:
        return (arch.hidden_size,)
    split = split_layer_name(name)
    if split is None or split[1] not in LAYER_SUFFIXES:
        raise ValueError(f"{name!r} is not a Llama parameter name")
    suffix = split[1]
    hidden, inter = arch.hidden_size, arch.intermediate_size
    shapes = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (arch.q_size, hidden),
        "self_attn.k_proj.weight": (arch.kv_size, hidden),
        "self_attn.v_proj.weight": (arch.kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, arch.q_size),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    return shapes[suffix]
