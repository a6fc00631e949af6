"""Build a tokenizer from the `tokenizer.*` metadata of a GGUF file.

Contract: `build_from_gguf(path)` returns a `GGUFTokenizerParts` whose backend
tokenizes like the model's original `tokenizer.json` (and like llama.cpp):
vocabulary and merges from the file, the pre-tokenizer picked by
`tokenizer.ggml.pre` through `PRE_TOKENIZERS`, control tokens (type 3) added
as special tokens and user-defined ones (type 4) as plain added tokens, BOS
prepended iff `tokenizer.ggml.add_bos_token`. Only byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) is supported; any other model, or an
unknown pre-tokenizer name, raises `ValueError` naming it.

Note: transformers' own GGUF loader ignores `pre = "smollm"` and uses a plain
ByteLevel pre-tokenizer, so it differs from SmolLM2's `tokenizer.json` (and
from us) on whitespace runs before digits ("a  1"). We follow `tokenizer.json`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex, Tokenizer, pre_tokenizers
from tokenizers.pre_tokenizers import PreTokenizer

from asyncpp.tokenizer.bpe_backend import build_bpe_backend
from asyncpp.gguf_file import read_gguf_metadata

# llama.cpp's token types (gguf.TokenType); only these two change tokenization.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Llama-3's split regex (tiktoken cl100k style): digits in groups of up to 3.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class BpeFlavor:
    """How one model family's BPE differs: its pre-tokenizer, and whether a
    pre-token already in the vocabulary skips the merges (Llama-3 does)."""

    pre_tokenizer: PreTokenizer
    ignore_merges: bool = False


def _gpt2_flavor() -> BpeFlavor:
    return BpeFlavor(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))


def _smollm_flavor() -> BpeFlavor:
    # SmolLM2's tokenizer.json: every digit is its own pre-token, then GPT-2's regex.
    return BpeFlavor(pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ]))


def _llama3_flavor() -> BpeFlavor:
    return BpeFlavor(
        pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]),
        ignore_merges=True,
    )


# Keyed by `tokenizer.ggml.pre`, the names llama.cpp's converter writes.
PRE_TOKENIZERS: dict[str, Callable[[], BpeFlavor]] = {
    "default": _gpt2_flavor,
    "gpt2": _gpt2_flavor,
    "smollm": _smollm_flavor,
    "llama-bpe": _llama3_flavor,
}


@dataclass(frozen=True)
class GGUFTokenizerParts:
    backend: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None


def _build_gpt2(meta: dict[str, Any], path: str) -> GGUFTokenizerParts:
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens", path)
    merges_text: list[str] = meta.get("tokenizer.ggml.merges", [])  # writers drop empty arrays
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(f"{path}: {len(token_types)} token types for {len(tokens)} tokens")
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: unknown pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); "
                         f"supported: {sorted(PRE_TOKENIZERS)}")
    flavor = PRE_TOKENIZERS[pre_name]()
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens has duplicate tokens")
    merges = _parse_merges(merges_text, path)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    for name, token_id in (("bos", bos_id), ("eos", eos_id)):
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{name}_token_id {token_id} is outside "
                             f"the vocabulary of {len(tokens)} tokens")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    typed_tokens = list(zip(tokens, token_types, strict=True))
    try:
        backend = build_bpe_backend(
            vocab=vocab,
            merges=merges,
            pre_tokenizer=flavor.pre_tokenizer,
            ignore_merges=flavor.ignore_merges,
            special_tokens=[t for t, k in typed_tokens if k == _TOKEN_TYPE_CONTROL],
            user_tokens=[t for t, k in typed_tokens if k == _TOKEN_TYPE_USER_DEFINED],
            bos_token=tokens[bos_id] if add_bos and bos_id is not None else None,
        )
    except Exception as e:  # the Rust side raises a bare Exception, e.g. a merge of unknown tokens
        raise ValueError(f"{path}: invalid BPE vocabulary or merges ({e})") from e
    return GGUFTokenizerParts(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        chat_template=meta.get("tokenizer.chat_template"),
    )


# Keyed by `tokenizer.ggml.model`.
MODEL_BUILDERS: dict[str, Callable[[dict[str, Any], str], GGUFTokenizerParts]] = {
    "gpt2": _build_gpt2,
}


def build_from_gguf(path: str | os.PathLike[str]) -> GGUFTokenizerParts:
    path = os.fspath(path)
    meta = read_gguf_metadata(path)
    model = _require(meta, "tokenizer.ggml.model", path)
    if model not in MODEL_BUILDERS:
        raise ValueError(f"{path}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                         f"supported: {sorted(MODEL_BUILDERS)}")
    return MODEL_BUILDERS[model](meta, path)


def _parse_merges(merges_text: list[str], path: str) -> list[tuple[str, str]]:
    # Byte-level tokens never contain a real space, so exactly one separates the pair.
    merges = []
    for index, merge in enumerate(merges_text):
        left, sep, right = merge.partition(" ")
        if not (left and sep and right) or " " in right:
            raise ValueError(f"{path}: tokenizer.ggml.merges[{index}] = {merge!r} is not 'left right'")
        merges.append((left, right))
    return merges


def _require(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise ValueError(f"{path}: GGUF metadata has no {key!r}; is this a model file?")
    return meta[key]
