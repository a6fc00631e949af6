"""`load_tokenizer(source, path_or_name, vocab_size)`: pick a tokenizer by source.

Contract: `TOKENIZER_SOURCES` maps a source name to a loader:
    "gguf"    path to a GGUF file; None = the default SmolLM2-135M-Instruct
    "hf"      path to an HF tokenizer directory (required)
    "random"  the byte-level test vocabulary of `vocab_size` ids (required)
An unknown source, or a missing required argument, raises `ValueError`
listing what is expected; file errors propagate from the loaders.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncpp.model_files import default_gguf_path
from asyncpp.tokenizer.tokenizer import Tokenizer


def _load_gguf(path: str | None, vocab_size: int | None) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path() if path is None else path)


def _load_hf(path: str | None, vocab_size: int | None) -> Tokenizer:
    if path is None:
        raise ValueError("tokenizer source 'hf' needs the tokenizer directory path")
    return Tokenizer.from_hf_dir(path)


def _load_random(path: str | None, vocab_size: int | None) -> Tokenizer:
    if vocab_size is None:
        raise ValueError("tokenizer source 'random' needs vocab_size")
    return Tokenizer.byte_level(vocab_size)


TOKENIZER_SOURCES: dict[str, Callable[[str | None, int | None], Tokenizer]] = {
    "gguf": _load_gguf,
    "hf": _load_hf,
    "random": _load_random,
}


def load_tokenizer(source: str, path_or_name: str | None,
                   vocab_size: int | None = None) -> Tokenizer:
    if source not in TOKENIZER_SOURCES:
        raise ValueError(f"unknown tokenizer source {source!r}; known: {sorted(TOKENIZER_SOURCES)}")
    return TOKENIZER_SOURCES[source](path_or_name, vocab_size)
