"""The bundled SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own GGUF loading."""

from __future__ import annotations

import pytest
import torch

from asyncpp.model.arch import ModelArch
from asyncpp.weights import default_gguf_path, load_weights, read_arch
from tests.conftest import skip_without_real_model

pytestmark = pytest.mark.slow

COMPARED = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.29.self_attn.q_proj.weight",
    "model.layers.29.self_attn.k_proj.weight",
    "model.layers.29.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


@pytest.fixture(scope="module")
def gguf_path():
    skip_without_real_model()
    return default_gguf_path()


@pytest.fixture(scope="module")
def ours(gguf_path) -> dict[str, torch.Tensor]:
    first = load_weights("gguf", None, start_layer=0, end_layer=1, need_embed=True, need_head=True)
    last = load_weights("gguf", None, start_layer=29, end_layer=30, need_embed=False, need_head=False)
    return first | last


@pytest.fixture(scope="module")
def reference(hf_smollm2) -> dict[str, torch.Tensor]:
    state = hf_smollm2[1].state_dict()
    return {name: state[name] for name in COMPARED}


def test_real_arch(gguf_path) -> None:
    assert read_arch("gguf", str(gguf_path)) == ModelArch(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
    )


@pytest.mark.parametrize("name", COMPARED)
def test_matches_transformers_gguf_load(ours, reference, name: str) -> None:
    assert ours[name].shape == reference[name].shape
    assert torch.equal(ours[name], reference[name]), (ours[name] - reference[name]).abs().max()
