"""HF source: a directory with `config.json` and `*.safetensors` files.

Contract:
- Only Llama checkpoints are accepted: `model_type == "llama"` and, when
  `architectures` is given, it names `LlamaForCausalLM`.
- `rope_theta` is read top-level or from `rope_parameters` / `rope_scaling`
  (transformers 5 nests it); any rope type other than "default" is rejected,
  since the model implements plain RoPE only.
- Tensors are found through `model.safetensors.index.json` when present,
  otherwise by scanning every `*.safetensors` header; only requested tensors
  are read (`safe_open` is lazy), and any stored dtype becomes float32.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import safetensors
import torch

from asyncpp.model.arch import ModelArch

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_ARCHITECTURE = "LlamaForCausalLM"


class HfLoader:
    def read_arch(self, path_or_name: str | None) -> ModelArch:
        path = _directory(path_or_name) / CONFIG_FILE
        config = _read_json(path)
        try:
            return arch_from_config(config)
        except KeyError as e:
            raise ValueError(f"{path}: missing key {e}") from e
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def load(
        self, path_or_name: str | None, arch: ModelArch, names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        directory = _directory(path_or_name)
        file_of = _tensor_files(directory)
        by_file: dict[pathlib.Path, list[str]] = {}
        for name in names:
            if name not in file_of:
                raise ValueError(f"{directory}: tensor {name!r} is missing")
            by_file.setdefault(file_of[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            if not file.is_file():
                raise FileNotFoundError(f"safetensors file not found: {file}")
            try:
                with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in file_names:
                        out[name] = f.get_tensor(name).to(torch.float32).contiguous()
            except (safetensors.SafetensorError, OSError) as e:
                raise ValueError(f"{file}: cannot read safetensors ({e})") from e
        return out


def arch_from_config(config: dict[str, Any]) -> ModelArch:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or [_ARCHITECTURE]
    if model_type != "llama" or _ARCHITECTURE not in architectures:
        raise ValueError(
            f"unsupported architecture {architectures} (model_type {model_type!r}); "
            f"only {_ARCHITECTURE} is supported"
        )
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // num_heads
    return ModelArch(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=_rope_theta(config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        bos_token_id=_first_id(config.get("bos_token_id")),
        eos_token_id=_first_id(config.get("eos_token_id")),
    )


def _rope_theta(config: dict[str, Any]) -> float:
    theta = config.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if not params:
            continue
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope type {rope_type!r} in {key}; only 'default'")
        theta = params.get("rope_theta", theta)
    # transformers' LlamaConfig default, used when a config omits it.
    return float(theta if theta is not None else 10000.0)


def _first_id(value: Any) -> int | None:
    # Some configs list several eos ids; the model arch keeps the primary one.
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _directory(path_or_name: str | None) -> pathlib.Path:
    if path_or_name is None:
        raise ValueError("the hf source needs a directory path")
    directory = pathlib.Path(path_or_name)
    if not directory.is_dir():
        raise FileNotFoundError(f"HF model directory not found: {directory}")
    return directory


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _tensor_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: has no weight_map")
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    file_of: dict[str, pathlib.Path] = {}
    for file in files:
        try:
            with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
                file_of.update(dict.fromkeys(f.keys(), file))
        except (safetensors.SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read safetensors ({e})") from e
    return file_of
