"""Random source: named configs, determinism, slices, init scales."""

from __future__ import annotations

import math

import pytest
import torch

from asyncpp.weights import load_weights, read_arch
from asyncpp.weights.base import EMBED_NAME, LM_HEAD_NAME, NORM_NAME, layer_names
from asyncpp.weights.random_loader import RANDOM_CONFIGS

from weights_helpers import load_all


def test_tiny_llama_config_values() -> None:
    arch = read_arch("random", "tiny-llama")
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (320, 64, 128)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 4, 2, 16)
    assert arch.rope_theta == 10000.0 and arch.max_position_embeddings == 512
    assert (arch.bos_token_id, arch.eos_token_id, arch.tie_word_embeddings) == (1, 2, False)
    assert read_arch("random", "tiny-llama-6l").num_layers == 6
    assert read_arch("random", "tiny-llama-tied").tie_word_embeddings
    assert read_arch("random", None) == arch


@pytest.mark.parametrize("name", sorted(RANDOM_CONFIGS))
def test_slice_is_bit_identical_to_full_model(name: str) -> None:
    arch = read_arch("random", name)
    full = load_all("random", name, arch.num_layers)
    again = load_all("random", name, arch.num_layers)
    assert set(full) == set(again) and all(torch.equal(full[k], again[k]) for k in full)

    part = load_weights("random", name, start_layer=1, end_layer=3, need_embed=False, need_head=False)
    assert set(part) == set(layer_names(1) + layer_names(2))
    for key, value in part.items():
        assert torch.equal(value, full[key]), key
        assert value.dtype == torch.float32 and value.is_contiguous()


def test_tied_head_is_the_embedding() -> None:
    head_only = load_weights(
        "random", "tiny-llama-tied", start_layer=4, end_layer=4, need_embed=False, need_head=True
    )
    assert set(head_only) == {NORM_NAME, LM_HEAD_NAME}
    both = load_all("random", "tiny-llama-tied", 4)
    assert both[LM_HEAD_NAME] is both[EMBED_NAME]
    assert torch.equal(head_only[LM_HEAD_NAME], both[EMBED_NAME])


def test_configs_have_distinct_weights() -> None:
    name = layer_names(0)[1]
    a = load_weights("random", "tiny-llama", start_layer=0, end_layer=1, need_embed=False, need_head=False)
    b = load_weights("random", "tiny-llama-6l", start_layer=0, end_layer=1, need_embed=False, need_head=False)
    assert not torch.equal(a[name], b[name])
    # and distinct tensors of one config are not copies of each other
    assert not torch.equal(a[layer_names(0)[2]], a[layer_names(0)[3]])


def test_init_scales() -> None:
    arch = read_arch("random", "tiny-llama-6l")
    w = load_all("random", "tiny-llama-6l", arch.num_layers)
    assert abs(w[EMBED_NAME].std().item() - 1.0) < 0.05
    q = w["model.layers.3.self_attn.q_proj.weight"]
    assert abs(q.std().item() * math.sqrt(arch.hidden_size) - 1.0) < 0.05
    down = w["model.layers.5.mlp.down_proj.weight"]
    assert abs(down.std().item() * math.sqrt(arch.intermediate_size) - 1.0) < 0.05
    norm = w["model.layers.2.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.1 and 0.1 < norm.std().item() < 0.3


def test_unknown_config_name_lists_known() -> None:
    with pytest.raises(ValueError, match="tiny-llama-6l"):
        read_arch("random", "huge-llama")
    with pytest.raises(ValueError, match="huge-llama"):
        load_weights("random", "huge-llama", start_layer=0, end_layer=1, need_embed=False, need_head=False)


def test_bad_slice_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"\[2, 5\)"):
        load_weights("random", "tiny-llama", start_layer=2, end_layer=5, need_embed=False, need_head=False)
    with pytest.raises(ValueError):
        load_weights("random", "tiny-llama", start_layer=3, end_layer=2, need_embed=False, need_head=False)
