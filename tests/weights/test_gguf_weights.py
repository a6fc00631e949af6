"""GGUF loader on small files written here: every type, un-permutation, metadata, slices."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from asyncpp.weights import load_weights, read_arch
from asyncpp.weights.base import EMBED_NAME, LM_HEAD_NAME, NORM_NAME, layer_names
from asyncpp.weights.gguf_loader import unpermute_rows

from weights_helpers import (
    GGUF_ARCH,
    Q,
    converter_permute,
    load_all,
    random_hf_tensors,
    to_gguf_layout,
    write_llama_gguf,
)

# Max |error| allowed, as a fraction of the tensor's max |value|. Symmetric
# types (Q4_0, Q5_0) map the block's extreme to -2^(b-1) steps, so the other
# extreme is clipped by up to one full step; the others are off by half a step
# (plus f16 rounding of the block scales).
TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 4e-3,
    Q.Q8_0: 0.006,
    Q.Q5_0: 1 / 16 + 0.003,
    Q.Q5_1: 0.04,
    Q.Q4_0: 1 / 8 + 0.005,
    Q.Q4_1: 0.075,
    Q.Q2_K: 0.35,
    Q.Q3_K: 0.15,
    Q.Q4_K: 0.07,
    Q.Q5_K: 0.035,
    Q.Q6_K: 0.02,
}
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _quantize_or_skip(qtype: gguf.GGMLQuantizationType) -> None:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
    except NotImplementedError:
        pytest.skip(f"gguf cannot quantize {qtype.name} (dequantize-only)")


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_quantized_file_round_trip(tmp_path, qtype) -> None:
    _quantize_or_skip(qtype)
    arch = GGUF_ARCH
    original = random_hf_tensors(arch, seed=int(qtype))
    path = write_llama_gguf(tmp_path / "m.gguf", arch, original, qtype)
    loaded = load_all("gguf", str(path), arch.num_layers)
    assert set(loaded) == set(original)
    for name, weight in original.items():
        got = loaded[name].numpy()
        assert got.dtype == np.float32 and got.shape == weight.shape
        if weight.ndim == 2 and qtype != Q.F32:
            # Exactly what gguf decodes from the stored (permuted) blocks, once
            # the converter permutation is re-applied to our output.
            stored = gguf.quants.quantize(to_gguf_layout(arch, name, weight), qtype)
            decoded = gguf.quants.dequantize(stored, qtype).reshape(weight.shape)
            np.testing.assert_array_equal(to_gguf_layout(arch, name, got), decoded, err_msg=name)
        error = np.abs(got - weight).max()
        assert error <= TOLERANCE[qtype] * np.abs(weight).max(), (name, error)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_dequantize_only_types_from_raw_blocks(tmp_path, qtype) -> None:
    """K-quant files (gguf cannot quantize them) decode block for block."""
    arch = GGUF_ARCH
    original = random_hf_tensors(arch)
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = {}
    for name, weight in original.items():
        if weight.ndim == 2:
            rows, cols = weight.shape
            blocks = rng.integers(0, 256, (rows, cols // block_size * type_size), np.uint8)
            # Keep every f16 block scale finite, wherever it sits in the block:
            # no byte may carry an all-ones f16 exponent (bits 2..6 of the high byte).
            blocks[(blocks & 0x7C) == 0x7C] ^= 0x40
            raw[name] = (blocks, qtype)
    path = write_llama_gguf(tmp_path / "k.gguf", arch, original, Q.F32, raw=raw)
    loaded = load_all("gguf", str(path), arch.num_layers)
    for name, (blocks, _) in raw.items():
        decoded = gguf.quants.dequantize(blocks, qtype).reshape(original[name].shape)
        assert np.isfinite(decoded).all() and np.abs(decoded).max() > 0
        np.testing.assert_array_equal(to_gguf_layout(arch, name, loaded[name].numpy()), decoded)


@pytest.mark.parametrize("num_heads, head_dim", [(4, 64), (3, 8), (1, 4), (8, 16)])
def test_unpermute_is_the_inverse_of_the_converter(num_heads, head_dim) -> None:
    weight = np.random.default_rng(0).standard_normal((num_heads * head_dim, 24)).astype(np.float32)
    permuted = converter_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rows(permuted, num_heads), weight)
    np.testing.assert_array_equal(converter_permute(unpermute_rows(weight, num_heads), num_heads), weight)


def test_metadata_becomes_arch(tmp_path) -> None:
    # head_dim (key_length) deliberately differs from hidden / heads.
    arch = dataclasses.replace(
        GGUF_ARCH, hidden_size=64, intermediate_size=96, head_dim=32, vocab_size=50, num_kv_heads=1
    )
    path = write_llama_gguf(tmp_path / "m.gguf", arch, random_hf_tensors(arch))
    assert read_arch("gguf", str(path)) == arch
    loaded = load_all("gguf", str(path), arch.num_layers)
    assert loaded["model.layers.1.self_attn.q_proj.weight"].shape == (128, 64)
    assert loaded["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)


def test_vocab_size_falls_back_to_token_list(tmp_path) -> None:
    arch = dataclasses.replace(GGUF_ARCH, hidden_size=64, intermediate_size=96, head_dim=16)
    path = write_llama_gguf(tmp_path / "m.gguf", arch, random_hf_tensors(arch), with_vocab_size=False)
    assert read_arch("gguf", str(path)).vocab_size == arch.vocab_size


def test_tied_file_has_no_output_tensor(tmp_path) -> None:
    arch = dataclasses.replace(GGUF_ARCH, tie_word_embeddings=True)
    tensors = random_hf_tensors(arch)
    assert LM_HEAD_NAME not in tensors
    path = write_llama_gguf(tmp_path / "t.gguf", arch, tensors)
    assert read_arch("gguf", str(path)).tie_word_embeddings
    head = load_weights("gguf", str(path), start_layer=2, end_layer=2, need_embed=False, need_head=True)
    assert set(head) == {NORM_NAME, LM_HEAD_NAME}
    np.testing.assert_array_equal(head[LM_HEAD_NAME].numpy(), tensors[EMBED_NAME])


def test_slice_dequantizes_only_its_own_tensors(tmp_path, monkeypatch) -> None:
    arch = GGUF_ARCH
    original = random_hf_tensors(arch)
    path = write_llama_gguf(tmp_path / "m.gguf", arch, original, Q.Q8_0)
    full = load_all("gguf", str(path), arch.num_layers)

    dequantized: list[int] = []
    real = gguf.quants.dequantize

    def counting(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        dequantized.append(data.size)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    part = load_weights("gguf", str(path), start_layer=1, end_layer=2, need_embed=False, need_head=False)
    assert set(part) == set(layer_names(1))
    assert len(dequantized) == len(layer_names(1))
    for name, value in part.items():
        assert torch.equal(value, full[name]), name
