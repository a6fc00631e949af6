"""GGUF source: a llama.cpp model file, memory-mapped (`asyncpp.gguf_file`).

Contract:
- Only `general.architecture == "llama"` files are accepted.
- Tensors are dequantized with `gguf.quants.dequantize` (numpy), one tensor at
  a time and only those asked for, then reshaped to the HF [rows, cols]
  layout (GGUF lists dims innermost-first, so its `shape` is reversed).
- q/k rows are un-permuted: llama.cpp's converter reorders each head's rows
  from HF rotate-half order to interleaved-pair order; the model here uses
  rotate-half, so the inverse is applied.
- Any tensor type `gguf.quants` cannot dequantize is a ValueError naming the
  tensor and the type; so is a missing tensor or a missing metadata key.
- `load_stored` (`weight_format = "native"`) hands 2-D weights out as
  `StoredTensor`s, the file's rows as they are (q/k rows un-permuted, which
  moves whole rows); a type without a native kernel is a ValueError naming the
  tensor and its type.

The header is read with a struct-based reader (0.25 s for SmolLM2, where
`gguf.GGUFReader` takes ~5 s wrapping each tokenizer string); one parsed file
is cached per process, keyed by size and mtime so a rewritten file is read again.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np
import torch

from asyncpp.gguf_file import GGUFFile, GGUFTensorInfo
from asyncpp.model.arch import ModelArch
from asyncpp.model_files import default_gguf_path
from asyncpp.progress import track_weights
from asyncpp.weights.base import (
    EMBED_NAME,
    LM_HEAD_NAME,
    NORM_NAME,
    STORED_FORMATS,
    StoredTensor,
    expected_shape,
    split_layer_name,
)


_GLOBAL_NAMES = {
    EMBED_NAME: "token_embd.weight",
    NORM_NAME: "output_norm.weight",
    LM_HEAD_NAME: "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    split = split_layer_name(hf_name)
    if split is None or split[1] not in _LAYER_NAMES:
        raise ValueError(f"no GGUF name for {hf_name!r}")
    return f"blk.{split[0]}.{_LAYER_NAMES[split[1]]}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation, per head.

    The converter maps each head's rows as reshape(2, head_dim//2).T: row
    pairs (i, i + head_dim/2) become neighbours (2i, 2i+1). Here neighbours
    go back to halves.
    """
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


class GgufLoader:
    def read_arch(self, path_or_name: str | None) -> ModelArch:
        path = _resolve(path_or_name)
        return _arch_from_reader(path, _open_reader(path))

    def stored_bytes(self, path_or_name: str | None) -> int:
        """Every tensor's bytes in the file's own formats (metadata only)."""
        return sum(tensor.num_bytes for tensor in _open_reader(_resolve(path_or_name)).tensors.values())

    def load(
        self, path_or_name: str | None, arch: ModelArch, names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        path = _resolve(path_or_name)
        gguf_file = _open_reader(path)
        tensors_by_name = gguf_file.tensors
        out: dict[str, torch.Tensor] = {}
        for name in track_weights(names, path.name):  # progress only: yields `names` unchanged
            gguf_name = gguf_tensor_name(name)
            tensor = tensors_by_name.get(gguf_name)
            if tensor is None:
                raise ValueError(f"{path}: tensor {gguf_name!r} (for {name!r}) is missing")
            weight = _dequantize(path, gguf_file, tensor)
            if weight.shape != expected_shape(arch, name):
                raise ValueError(
                    f"{path}: tensor {gguf_name!r} has HF shape {weight.shape}, "
                    f"expected {expected_shape(arch, name)}"
                )
            if name.endswith("self_attn.q_proj.weight"):
                weight = unpermute_rows(weight, arch.num_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                weight = unpermute_rows(weight, arch.num_kv_heads)
            out[name] = torch.from_numpy(np.ascontiguousarray(weight))
        return out


    def load_stored(
        self, path_or_name: str | None, arch: ModelArch, names: Sequence[str]
    ) -> dict[str, torch.Tensor | StoredTensor]:
        """Like `load`, but 2-D weights stay in the file's format (`StoredTensor`)."""
        path = _resolve(path_or_name)
        gguf_file = _open_reader(path)
        out: dict[str, torch.Tensor | StoredTensor] = {}
        floats = []
        for name in names:
            tensor = gguf_file.tensors.get(gguf_tensor_name(name))
            if tensor is None:
                raise ValueError(f"{path}: tensor {gguf_tensor_name(name)!r} (for {name!r}) is missing")
            if len(expected_shape(arch, name)) == 1:
                floats.append(name)
                continue
            out[name] = _stored(path, gguf_file, tensor, name, arch)
        out.update(self.load(path_or_name, arch, floats))
        return out


def _stored(path: pathlib.Path, gguf_file: GGUFFile, tensor: GGUFTensorInfo, name: str, arch: ModelArch) -> StoredTensor:
    fmt = tensor.qtype.name.lower()
    if fmt not in STORED_FORMATS:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has type {tensor.qtype.name}, which model.weight_format = \"native\" "
            f"has no kernel for (native: {', '.join(f.upper() for f in STORED_FORMATS)}); "
            f"use model.weight_format = \"float\""
        )
    shape = tuple(tensor.hf_shape)
    if shape != expected_shape(arch, name):
        raise ValueError(f"{path}: tensor {tensor.name!r} has HF shape {shape}, expected {expected_shape(arch, name)}")
    rows = torch.from_numpy(np.array(gguf_file.raw(tensor), copy=True)).view(torch.uint8).reshape(shape[0], -1)
    stored = StoredTensor(fmt, rows, shape, tensor.name)
    if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = arch.num_heads if name.endswith("q_proj.weight") else arch.num_kv_heads
        order = unpermute_rows(np.arange(shape[0])[:, None], heads)[:, 0]
        stored = stored.select_rows(torch.from_numpy(np.ascontiguousarray(order)))
    return stored


def _resolve(path_or_name: str | None) -> pathlib.Path:
    path = default_gguf_path() if path_or_name is None else pathlib.Path(path_or_name)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path


def _open_reader(path: pathlib.Path) -> GGUFFile:
    stat = path.stat()
    return _cached_reader(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # cache key only
    try:
        return GGUFFile(path)
    except (OSError, ValueError):
        raise
    except Exception as e:  # anything else from bad bytes is still a bad file, named
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


def _dequantize(path: pathlib.Path, gguf_file: GGUFFile, tensor: GGUFTensorInfo) -> np.ndarray:
    qtype = tensor.qtype
    try:
        values = gguf.quants.dequantize(gguf_file.raw(tensor), qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has type {qtype.name}, which gguf cannot dequantize"
        ) from e
    values = values.reshape(tensor.hf_shape)
    if values.dtype != np.float32 or not values.flags.writeable:
        # F32 comes back as a read-only view of the memory map.
        values = values.astype(np.float32, copy=True)
    return values


def _arch_from_reader(path: pathlib.Path, reader: GGUFFile) -> ModelArch:
    meta = _Metadata(path, reader.metadata)
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{path}: unsupported architecture {architecture!r} (only 'llama')")
    scaling = meta.get("llama.rope.scaling.type", "none")
    tensor_names = set(reader.tensors)
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: rope scaling ({scaling!r}, rope_freqs) is not supported")
    hidden = int(meta.get("llama.embedding_length"))
    num_heads = int(meta.get("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // num_heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary (rope dim {rope_dim} != head dim {head_dim})")
    vocab = meta.get("llama.vocab_size", None)
    if vocab is None:
        vocab = meta.array_length("tokenizer.ggml.tokens")
    return ModelArch(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta.get("llama.feed_forward_length")),
        num_layers=int(meta.get("llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=_f32(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(meta.get("llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(meta.get("llama.context_length")),
        bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id", None)),
        eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id", None)),
    )


_REQUIRED = object()


class _Metadata:
    """Typed access to the header's key/values, naming the file and key on errors."""

    def __init__(self, path: pathlib.Path, fields: dict[str, Any]) -> None:
        self._path = path
        self._fields = fields

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self._fields:
            if default is _REQUIRED:
                raise ValueError(f"{self._path}: metadata key {key!r} is missing")
            return default
        value = self._fields[key]
        if isinstance(value, list):
            raise ValueError(f"{self._path}: metadata key {key!r} is an array, expected a scalar")
        return value

    def array_length(self, key: str) -> int:
        if key not in self._fields:
            raise ValueError(f"{self._path}: metadata key {key!r} is missing")
        return len(self._fields[key])


def _f32(value: float) -> float:
    # GGUF stores float32; its shortest repr gives back the value the model
    # author wrote (1e-05, not 9.99999974738e-06).
    return float(str(np.float32(value)))


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
