"""HF export + HF loader: round trips, slices, transformers compatibility, bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from asyncpp.weights import load_weights, read_arch, save_hf_directory
from asyncpp.weights.base import EMBED_NAME, LM_HEAD_NAME, layer_names
from asyncpp.weights.random_loader import RANDOM_CONFIGS

from weights_helpers import load_all

CONFIGS = sorted(RANDOM_CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_is_exact(saved_random_model, name: str) -> None:
    arch, tensors, directory = saved_random_model[name]
    assert read_arch("hf", str(directory)) == arch
    loaded = load_all("hf", str(directory), arch.num_layers)
    assert set(loaded) == set(tensors)
    for key in tensors:
        assert torch.equal(loaded[key], tensors[key]), key


@pytest.mark.parametrize("name", CONFIGS)
def test_slice_matches_full_load_and_nothing_else(saved_random_model, name: str) -> None:
    arch, _, directory = saved_random_model[name]
    full = load_all("hf", str(directory), arch.num_layers)
    part = load_weights("hf", str(directory), start_layer=1, end_layer=3, need_embed=False, need_head=False)
    assert set(part) == set(layer_names(1) + layer_names(2))
    for key, value in part.items():
        assert torch.equal(value, full[key]), key


def test_tied_head_comes_from_embedding_in_file(saved_random_model) -> None:
    arch, tensors, directory = saved_random_model["tiny-llama-tied"]
    head = load_weights("hf", str(directory), start_layer=4, end_layer=4, need_embed=False, need_head=True)
    assert torch.equal(head[LM_HEAD_NAME], tensors[EMBED_NAME])


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_loads_saved_directory(saved_random_model, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    arch, tensors, directory = saved_random_model[name]
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        str(directory), output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert rope["rope_theta"] == arch.rope_theta and model.config.head_dim == arch.head_dim
    assert model.config.tie_word_embeddings == arch.tie_word_embeddings
    state = model.state_dict()
    assert set(state) == set(tensors) | {LM_HEAD_NAME}
    for key, value in state.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, tensors[key]), key


def test_bf16_export_loads_as_float32(saved_random_model, tmp_path) -> None:
    arch, tensors, _ = saved_random_model["tiny-llama"]
    save_hf_directory(tmp_path, arch, tensors, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_all("hf", str(tmp_path), arch.num_layers)
    for key, value in loaded.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, tensors[key].to(torch.bfloat16).float()), key


def test_sharded_directory_uses_index(saved_random_model, tmp_path) -> None:
    arch, tensors, directory = saved_random_model["tiny-llama"]
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, file_names in shards.items():
        save_file({n: tensors[n] for n in file_names}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(file_names, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_all("hf", str(tmp_path), arch.num_layers)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_transformers5_config_with_rope_parameters(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, rope_theta=123456.0,
        tie_word_embeddings=True, max_position_embeddings=77, bos_token_id=5, eos_token_id=[6, 7],
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    arch = read_arch("hf", str(tmp_path))
    assert arch.rope_theta == 123456.0 and arch.head_dim == 8 and arch.num_kv_heads == 1
    assert arch.tie_word_embeddings and arch.max_position_embeddings == 77
    assert (arch.bos_token_id, arch.eos_token_id) == (5, 6)


def _write_config(directory, **overrides) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10,
        "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2,
    }
    config.update(overrides)
    (directory / "config.json").write_text(json.dumps(config))


def test_rope_theta_nested_or_top_level(tmp_path) -> None:
    _write_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert read_arch("hf", str(tmp_path)).rope_theta == 5e5
    _write_config(tmp_path, rope_theta=2e4, rope_scaling=None)
    assert read_arch("hf", str(tmp_path)).rope_theta == 2e4


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
    ],
)
def test_rope_scaling_is_rejected(tmp_path, overrides) -> None:
    _write_config(tmp_path, **overrides)
    with pytest.raises(ValueError, match="rope type"):
        read_arch("hf", str(tmp_path))


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ],
)
def test_unsupported_architecture(tmp_path, overrides, named) -> None:
    _write_config(tmp_path, **overrides)
    with pytest.raises(ValueError, match=named):
        read_arch("hf", str(tmp_path))


def test_missing_tensor_is_named(saved_random_model, tmp_path) -> None:
    arch, tensors, directory = saved_random_model["tiny-llama"]
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    victim = "model.layers.2.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != victim}, str(tmp_path / "model.safetensors"))
    # layers outside the missing one still load
    load_weights("hf", str(tmp_path), start_layer=0, end_layer=2, need_embed=True, need_head=True)
    with pytest.raises(ValueError, match=victim):
        load_weights("hf", str(tmp_path), start_layer=2, end_layer=3, need_embed=False, need_head=False)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_is_named(saved_random_model, tmp_path, damage) -> None:
    _, _, directory = saved_random_model["tiny-llama"]
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    data = (directory / "model.safetensors").read_bytes()
    bad = b"\x13\x37garbage" * 100 if damage == "garbage" else data[: len(data) // 2]
    (tmp_path / "model.safetensors").write_bytes(bad)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_weights("hf", str(tmp_path), start_layer=0, end_layer=1, need_embed=False, need_head=False)


def test_corrupt_config_is_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        read_arch("hf", str(tmp_path))


def test_missing_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_arch("hf", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_arch("hf", str(tmp_path))
    _write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_weights("hf", str(tmp_path), start_layer=0, end_layer=1, need_embed=False, need_head=False)


def test_export_rejects_incomplete_tensors(saved_random_model, tmp_path) -> None:
    arch, tensors, _ = saved_random_model["tiny-llama"]
    partial = dict(tensors)
    del partial["model.layers.3.self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match="o_proj"):
        save_hf_directory(tmp_path, arch, partial)
