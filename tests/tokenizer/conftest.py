"""Shared fixtures: the real SmolLM2 tokenizer (ours and transformers'), loaded once.

Loading transformers' GGUF tokenizer takes ~7-10 s, so it is session-scoped and
only requested by the parity tests. `make_tokenizer_gguf` gives tests a
writer of small synthetic GGUF files (a fixture, so no test imports conftest).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import gguf
import pytest

from asyncpp.tokenizer import Tokenizer, default_gguf_path
from asyncpp.tokenizer.bpe_backend import BYTE_TO_CHAR
from tests.conftest import skip_without_real_model


@pytest.fixture(scope="session")
def smollm_gguf_path() -> pathlib.Path:
    skip_without_real_model()
    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm(smollm_gguf_path: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_gguf_path)


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf_path: pathlib.Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm_gguf_path.parent), gguf_file=smollm_gguf_path.name)


@pytest.fixture
def make_tokenizer_gguf():
    return _write_tokenizer_gguf


def _write_tokenizer_gguf(path: pathlib.Path, *, model: str = "gpt2", pre: str | None = "gpt2",
                         extra_tokens: Sequence[tuple[str, int]] = (),
                         merges: Sequence[str] = (), add_bos: bool = False) -> list[str]:
    """A tensor-free GGUF holding a byte-level vocabulary: `<|eot|>` (control,
    id 0), `<s>` (control, id 1), the 256 byte tokens, then `extra_tokens` as
    (token, token_type). Returns the token list (index = id)."""
    tokens = ["<|eot|>", "<s>", *(BYTE_TO_CHAR[b] for b in range(256))]
    token_types = [3, 3, *([1] * 256)]
    for token, token_type in extra_tokens:
        tokens.append(token)
        token_types.append(token_type)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_string("tokenizer.ggml.model", model)
    if pre is not None:
        writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", token_types)
    writer.add_array("tokenizer.ggml.merges", list(merges))
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 0)
    writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    writer.add_string("tokenizer.chat_template",
                      "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens
