"""Structured-output fixtures: the tiny model's byte-level tokenizer and a grammar compiler on it."""

from __future__ import annotations

import pytest

from asyncpp.tokenizer.tokenizer import Tokenizer

pytest.importorskip("llguidance")
TINY_VOCAB = 300  # the tiny model's (tests/conftest.py TINY): bytes, then merges, then specials


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_hf_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_hf_dir)


@pytest.fixture
def compiler(tiny_tokenizer):
    from asyncpp.structured.compiler import GrammarCompiler

    return GrammarCompiler(tiny_tokenizer, tiny_tokenizer.vocab_size)
