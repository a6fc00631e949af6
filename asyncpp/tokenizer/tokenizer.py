"""`Tokenizer`: text <-> token ids, special tokens and the chat template.

Contract: a thin typed wrapper over a Rust `tokenizers.Tokenizer` holding a
byte-level BPE (built from GGUF metadata, an HF directory, or the byte-level
test vocabulary). `encode` maps special-token text such as `<|im_start|>` to
its single id and prepends BOS iff `add_bos_token` (the backend's
post-processor decides; we only report it). `decode` skips special tokens by
default. Ids and text match `transformers` loading the same files, except the
GGUF pre-tokenizer note in `gguf_tokenizer`. Instances are immutable after
construction and safe to share.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from asyncpp.tokenizer.bpe_backend import token_bytes
from asyncpp.tokenizer.byte_level import build_byte_level
from asyncpp.tokenizer.chat_template import ChatTemplate
from asyncpp.tokenizer.gguf_tokenizer import build_from_gguf
from asyncpp.tokenizer.hf_dir import read_hf_dir, write_hf_dir


class Tokenizer:
    def __init__(self, backend: RustTokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, chat_template: str | None) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._chat_template_source = chat_template
        self._chat_template: ChatTemplate | None = None  # compiled on first use
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special)
        self._add_bos_token = (bos_token_id is not None and
                               backend.encode("", add_special_tokens=True).ids[:1] == [bos_token_id])
        self._token_bytes: list[bytes] | None = None  # built on first use
        self._token_bytes_by_id: dict[bool, dict[int, bytes]] = {}  # by skip_special_tokens, built on first use

    # -- constructors ------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        parts = build_from_gguf(path)
        return cls(parts.backend, bos_token_id=parts.bos_token_id,
                   eos_token_id=parts.eos_token_id, chat_template=parts.chat_template)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        parts = read_hf_dir(path)
        return cls(parts.backend, bos_token_id=parts.bos_token_id,
                   eos_token_id=parts.eos_token_id, chat_template=parts.chat_template)

    @classmethod
    def byte_level(cls, vocab_size: int) -> Tokenizer:
        """The merge-free byte vocabulary of tiny random models (layout in `byte_level`)."""
        parts = build_byte_level(vocab_size)
        return cls(parts.backend, bos_token_id=parts.bos_token_id,
                   eos_token_id=parts.eos_token_id, chat_template=parts.chat_template)

    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json`, loadable by `from_hf_dir`
        and by `transformers.AutoTokenizer`."""
        write_hf_dir(directory, backend=self._backend, bos_token=self._token_text(self._bos_token_id),
                     eos_token=self._token_text(self._eos_token_id),
                     add_bos_token=self._add_bos_token, chat_template=self._chat_template_source)

    # -- properties --------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """One past the largest token id (the model's embedding rows must cover it)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos_token

    # -- text <-> ids ------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """Vocabulary spellings (byte-level alphabet); None for an unknown id."""
        return [self._backend.id_to_token(i) for i in ids]

    def token_bytes_table(self) -> list[bytes]:
        """`table[id]` is the bytes `decode` produces for that id alone, before UTF-8
        decoding (special tokens included; b"" for an unused id). Built once."""
        if self._token_bytes is None:
            table = [b""] * self._vocab_size
            for token, token_id in self._backend.get_vocab(with_added_tokens=True).items():
                table[token_id] = token_bytes(token)
            self._token_bytes = table
        return self._token_bytes

    def token_bytes_by_id(self, skip_special_tokens: bool = True) -> dict[int, bytes]:
        """`token_bytes_table` as a map holding only the ids `decode` does not drop (unknown ids,
        and special ones when skipping): a detokenizer's one lookup per token. Built once."""
        by_id = self._token_bytes_by_id.get(skip_special_tokens)
        if by_id is None:
            skipped = self._special_ids if skip_special_tokens else frozenset()
            by_id = {i: b for i, b in enumerate(self.token_bytes_table()) if i not in skipped}
            self._token_bytes_by_id[skip_special_tokens] = by_id
        return by_id

    def backend_json(self) -> str:
        """The Rust tokenizer as `tokenizer.json` text (what grammar engines build their vocabulary from)."""
        return self._backend.to_str()

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    # -- chat --------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for `messages`; encode it with `add_special_tokens=False`
        when the template already writes BOS."""
        if self._chat_template_source is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        if self._chat_template is None:
            self._chat_template = ChatTemplate(
                self._chat_template_source, bos_token=self._token_text(self._bos_token_id),
                eos_token=self._token_text(self._eos_token_id))
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
