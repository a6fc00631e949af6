"""`GrammarCompiler`: a request's `StructuredOutputs` as an llguidance grammar, checked and cached.

Built on llguidance (PyPI `llguidance`, the grammar engine vLLM offers
beside xgrammar): an Earley parser over a lexer, whose token mask is
computed per step from the tokenizer's vocabulary, with no precompute per
grammar worth the name (about a millisecond for a nested JSON schema here).
Still, each spec is compiled once per process: `matcher(spec)` hands out a
deep copy of a matcher made the first time, and a spec that fails is
remembered with its error (`stats`: compiles, cache hits, compile time).

Kinds: a JSON schema (`json`, llguidance's JSON compiler, whitespace as
JSON allows), any JSON object (`json_object`), a regex (Rust `regex`
syntax, matched in full), a choice (one Lark rule of string literals), a
grammar (GBNF, converted by llguidance's own converter, or Lark). The
mask lets end-of-sequence through only once the grammar accepts, and
forces it once nothing else may follow: a complete answer ends with
`finish_reason: "stop"`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.structured import StructuredOutputs

MAX_CACHED = 512  # compiled specs kept per process (oldest dropped first)
JSON_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: asyncpp's `Tokenizer` (its Rust backend is handed to llguidance as JSON);
        `vocab_size`: the model's logits width (tokens past the tokenizer's are never allowed)."""
        self.vocab_size = vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        self.lltokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=self.eos_token_id)
        self._cache: dict[StructuredOutputs, llguidance.LLMatcher | str] = {}  # a matcher, or why it failed
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_s: list[float] = []  # each compile's time, first use only

    def check(self, spec: StructuredOutputs) -> None:
        """`InvalidRequestError` naming the field if the spec does not compile."""
        self._template(spec)

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for one request (a copy of the cached one)."""
        return self._template(spec).deep_copy()

    def _template(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        cached = self._cache.get(spec)
        if cached is None:
            t0 = time.perf_counter()
            cached = self._compile(spec)
            self.compile_s.append(time.perf_counter() - t0)
            self.num_compiled += 1
            if len(self._cache) >= MAX_CACHED:
                del self._cache[next(iter(self._cache))]
            self._cache[spec] = cached
        else:
            self.num_cache_hits += 1
        if isinstance(cached, str):
            raise InvalidRequestError(spec.field, cached)
        return cached

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher | str:
        try:
            grammar = grammar_text(spec)
        except Exception as e:  # noqa: BLE001 - the request's own text, through a third-party converter
            return f"{spec.field} does not compile: {e}"
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"{spec.field} does not compile: {matcher.get_error()}"
        return matcher

    def stats(self) -> dict[str, Any]:
        return {
            "grammar_num_compiled": self.num_compiled,
            "grammar_num_cache_hits": self.num_cache_hits,
            "grammar_compile_s_max": max(self.compile_s, default=0.0),
        }


def grammar_text(spec: StructuredOutputs) -> str:
    """The spec as llguidance's grammar text (`ValueError` if it cannot be one)."""
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.value)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if spec.kind == "grammar":
        text = spec.value
        if "::=" in text:  # GBNF / EBNF, as llama.cpp and xgrammar write it
            text = gbnf_to_lark(text)
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise ValueError(f"unknown kind {spec.kind!r}")
