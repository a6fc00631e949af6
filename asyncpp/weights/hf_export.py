"""Write a full model as an HF Llama directory (`config.json` + `model.safetensors`).

Contract: the directory loads with `transformers.LlamaForCausalLM.from_pretrained`
without missing or unexpected keys, and with our `hf` loader to the same
tensors (exactly, for dtype float32). `tensors` must hold exactly the full
model's parameters; `lm_head.weight` may be omitted or given when tied, and is
never written then (transformers re-ties it to the embedding). Tokenizer
files are another module's job.

The config is written with plain keys (`rope_theta` top-level) that both
transformers 4.x and 5.x read; this module does not import transformers.
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file

from asyncpp.model.arch import ModelArch
from asyncpp.weights.base import LM_HEAD_NAME, expected_shape, full_model_names
from asyncpp.weights.hf_loader import CONFIG_FILE

SAFETENSORS_FILE = "model.safetensors"


def hf_config(arch: ModelArch, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": arch.rms_norm_eps,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "max_position_embeddings": arch.max_position_embeddings,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def save_hf_directory(
    directory: str | pathlib.Path,
    arch: ModelArch,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> pathlib.Path:
    """Writes the directory (created if needed) and returns its path."""
    directory = pathlib.Path(directory)
    names = full_model_names(arch)
    given = set(tensors) - ({LM_HEAD_NAME} if arch.tie_word_embeddings else set())
    if given != set(names):
        missing, extra = sorted(set(names) - given), sorted(given - set(names))
        raise ValueError(f"tensors do not match the full model: missing {missing}, unexpected {extra}")
    for name in names:
        if tuple(tensors[name].shape) != expected_shape(arch, name):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                f"expected {expected_shape(arch, name)}"
            )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config(arch, dtype), indent=2) + "\n")
    # clone: safetensors refuses tensors sharing storage (e.g. views of one fused buffer).
    payload = {name: tensors[name].detach().to("cpu", dtype).contiguous().clone() for name in names}
    save_file(payload, str(directory / SAFETENSORS_FILE), metadata={"format": "pt"})
    return directory
