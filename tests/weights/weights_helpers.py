"""Helpers for weight-loader tests: write small GGUF files as llama.cpp's converter would.

The q/k permutation below is llama.cpp's HF->GGUF converter permutation written
from its definition (rows as (n_head, 2, head_dim//2, cols), axes 1 and 2
swapped), independently of the loader's inverse.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import gguf
import numpy as np
import torch

from asyncpp.model.arch import ModelArch
from asyncpp.weights import load_weights
from asyncpp.weights.base import expected_shape, full_model_names
from asyncpp.weights.gguf_loader import gguf_tensor_name

Q = gguf.GGMLQuantizationType


def converter_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


def to_gguf_layout(arch: ModelArch, name: str, weight: np.ndarray) -> np.ndarray:
    """What the converter stores for HF tensor `name` (before quantization)."""
    if name.endswith("q_proj.weight"):
        return converter_permute(weight, arch.num_heads)
    if name.endswith("k_proj.weight"):
        return converter_permute(weight, arch.num_kv_heads)
    return weight


def random_hf_tensors(arch: ModelArch, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for name in full_model_names(arch):
        tensors[name] = rng.standard_normal(expected_shape(arch, name)).astype(np.float32)
    return tensors


def write_llama_gguf(
    path: pathlib.Path,
    arch: ModelArch,
    hf_tensors: dict[str, np.ndarray],
    qtype: gguf.GGMLQuantizationType = Q.F32,
    *,
    architecture: str = "llama",
    raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    with_vocab_size: bool = True,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> pathlib.Path:
    """Writes `hf_tensors` the way llama.cpp's converter would.

    2-D tensors are permuted (q/k) and quantized to `qtype`; 1-D norms stay
    F32. `raw` maps HF names to already-encoded GGUF-layout bytes, stored as is.
    """
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(arch.num_layers)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_rope_dimension_count(arch.head_dim)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    if with_vocab_size:
        writer.add_vocab_size(arch.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(arch.vocab_size)])
    if arch.bos_token_id is not None:
        writer.add_bos_token_id(arch.bos_token_id)
    if arch.eos_token_id is not None:
        writer.add_eos_token_id(arch.eos_token_id)
    if extra is not None:
        extra(writer)
    for name, weight in hf_tensors.items():
        if raw and name in raw:
            data, raw_type = raw[name]
            writer.add_tensor(gguf_tensor_name(name), data, raw_dtype=raw_type)
            continue
        weight = to_gguf_layout(arch, name, weight)
        if weight.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(gguf_tensor_name(name), weight.astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(gguf_tensor_name(name), weight.astype(np.float16))
        else:
            writer.add_tensor(
                gguf_tensor_name(name), gguf.quants.quantize(weight, qtype), raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A small llama shape whose rows suit every block size (K-quants need 256).
GGUF_ARCH = ModelArch(
    vocab_size=40,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=1024,
    bos_token_id=3,
    eos_token_id=4,
)


def load_all(source: str, path_or_name: str | None, num_layers: int) -> dict[str, torch.Tensor]:
    return load_weights(
        source, path_or_name, start_layer=0, end_layer=num_layers, need_embed=True, need_head=True
    )
