"""Read and write a tokenizer as an HF directory (`tokenizer.json` + config).

Contract: `read_hf_dir(directory)` loads `tokenizer.json` and, when present,
`tokenizer_config.json` (`bos_token`, `eos_token`, `chat_template`) and
`chat_template.jinja` (newer transformers write the template there; it wins
over the config's). Whether BOS is added is up to `tokenizer.json`'s
post-processor alone; the config's `add_bos_token` is ignored, as
transformers (v5) does for byte-level tokenizers. A missing directory or
`tokenizer.json` raises `FileNotFoundError`; an unreadable file, a named
special token absent from the vocabulary, or a decoder other than byte-level
raises `ValueError`; all name the file. `write_hf_dir` writes what
`read_hf_dir` and `transformers.AutoTokenizer.from_pretrained` both load to
the same ids.

Only byte-level decoders are accepted because incremental detokenization
maps each id to its bytes (see `Tokenizer.token_bytes_table`).
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer, decoders

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class HFDirParts:
    backend: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None


def read_hf_dir(directory: str | os.PathLike[str]) -> HFDirParts:
    root = pathlib.Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {root}")
    tokenizer_path = root / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"{tokenizer_path} not found")
    try:
        backend = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # the Rust side raises a bare Exception on bad JSON
        raise ValueError(f"{tokenizer_path}: not a valid tokenizer.json ({e})") from e
    if not isinstance(backend.decoder, decoders.ByteLevel):
        raise ValueError(f"{tokenizer_path}: decoder {type(backend.decoder).__name__} is not "
                         f"supported; asyncpp handles byte-level BPE tokenizers only")

    config = _read_json(root / CONFIG_FILE) if (root / CONFIG_FILE).is_file() else {}
    bos_id = _token_id(backend, _token_content(config.get("bos_token")), root / CONFIG_FILE)
    eos_id = _token_id(backend, _token_content(config.get("eos_token")), root / CONFIG_FILE)
    template_path = root / TEMPLATE_FILE
    if template_path.is_file():
        try:
            chat_template: str | None = template_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{template_path}: cannot read ({e})") from e
    else:
        chat_template = _pick_template(config.get("chat_template"))
    return HFDirParts(backend, bos_id, eos_id, chat_template)


def write_hf_dir(directory: str | os.PathLike[str], *, backend: Tokenizer, bos_token: str | None,
                 eos_token: str | None, add_bos_token: bool, chat_template: str | None) -> None:
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / TOKENIZER_FILE))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "add_bos_token": add_bos_token,  # informational: tokenizer.json's post-processor decides
        # transformers would otherwise rewrite " ." to "." when decoding.
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                    encoding="utf-8")


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(entry: Any) -> str | None:
    # Configs store a special token as a string or as a serialized AddedToken.
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _token_id(backend: Tokenizer, token: str | None, config_path: pathlib.Path) -> int | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{config_path}: special token {token!r} is not in the vocabulary")
    return token_id


def _pick_template(entry: Any) -> str | None:
    # Older configs hold a list of named templates; the chat one is "default".
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    return entry if isinstance(entry, str) else None
