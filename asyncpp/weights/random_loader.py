"""Random source: named tiny Llama configs with deterministic random weights.

Contract:
- `path_or_name` is a config name from `RANDOM_CONFIGS` (None means
  "tiny-llama"); an unknown name is a ValueError listing the known ones.
- Each tensor comes from its own `torch.Generator`, seeded with
  crc32("<config>/<tensor name>"), so any slice of layers is bit-identical to
  the same layers of the full model and costs only its own generation.
- The init keeps activations O(1) and makes greedy decoding well separated:
  embeddings N(0,1); linears N(0, 1/in_features), so every projection of an
  RMS-normalised input is O(1) and each layer adds O(1) to the residual
  stream (no residual down-scaling: every layer must visibly change the
  output, or a wrong pipeline stage would go unnoticed); norm weights
  1 + 0.2 N(0,1), so a dropped norm weight changes results; an untied head
  N(0, (HEAD_LOGIT_STD / sqrt(hidden))^2), so logits have std ~HEAD_LOGIT_STD
  and the top-1 logit stands clear of the runner-up (tests/weights measure
  the gap). A tied head is the embedding, whose own token would then win
  every step (its self-logit is ~sqrt(hidden) std above the rest) and greedy
  decoding would just repeat the input: tied configs keep the embedding
  small (N(0, TIED_EMBED_STD^2)) and scale the final norm weights instead,
  so logits again have std ~HEAD_LOGIT_STD.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence

import torch

from asyncpp.model.arch import ModelArch
from asyncpp.weights.base import EMBED_NAME, LM_HEAD_NAME, NORM_NAME, expected_shape

DEFAULT_RANDOM_CONFIG = "tiny-llama"
HEAD_LOGIT_STD = 8.0
NORM_WEIGHT_STD = 0.2
TIED_EMBED_STD = 0.2

_TINY_LLAMA = ModelArch(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)

RANDOM_CONFIGS: dict[str, ModelArch] = {
    "tiny-llama": _TINY_LLAMA,
    # Six layers split evenly into 3 pipeline stages (and into 2).
    "tiny-llama-6l": dataclasses.replace(_TINY_LLAMA, num_layers=6),
    "tiny-llama-tied": dataclasses.replace(_TINY_LLAMA, tie_word_embeddings=True),
    # SmolLM2-135M's shape with random weights: speed work and exactness checks where the GGUF
    # cannot travel (the GPU machine).
    "smollm2-135m": ModelArch(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


class RandomLoader:
    def read_arch(self, path_or_name: str | None) -> ModelArch:
        return RANDOM_CONFIGS[_config_name(path_or_name)]

    def load(
        self, path_or_name: str | None, arch: ModelArch, names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        config = _config_name(path_or_name)
        return {name: random_tensor(config, arch, name) for name in names}


def random_tensor(config: str, arch: ModelArch, name: str) -> torch.Tensor:
    """The tensor `name` of random config `config`; depends on nothing else."""
    shape = expected_shape(arch, name)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(zlib.crc32(f"{config}/{name}".encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    tied = arch.tie_word_embeddings
    if len(shape) == 1:  # every 1-D parameter is an RMSNorm weight
        # A tied head gets its logit scale from the final norm, as the
        # embedding must stay small (see the module docstring).
        scale = _tied_head_gain(arch) if tied and name == NORM_NAME else 1.0
        return scale * (1.0 + NORM_WEIGHT_STD * values)
    if name == EMBED_NAME:
        return values * (TIED_EMBED_STD if tied else 1.0)
    if name == LM_HEAD_NAME:
        return values * (HEAD_LOGIT_STD / math.sqrt(shape[1]))
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # Writes into the residual stream: a deep model's stream would grow with depth.
        return values * _residual_gain(arch) / math.sqrt(shape[1])
    return values / math.sqrt(shape[1])


def _residual_gain(arch: ModelArch) -> float:
    """1 up to 8 layers (the tiny models); deeper, the residual stream stays O(1) over all layers."""
    return min(1.0, math.sqrt(8 / arch.num_layers))


def _tied_head_gain(arch: ModelArch) -> float:
    return HEAD_LOGIT_STD / (TIED_EMBED_STD * math.sqrt(arch.hidden_size))


def _config_name(path_or_name: str | None) -> str:
    name = DEFAULT_RANDOM_CONFIG if path_or_name is None else path_or_name
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random config {name!r}; known: {sorted(RANDOM_CONFIGS)}")
    return name
