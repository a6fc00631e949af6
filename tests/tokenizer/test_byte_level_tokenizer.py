"""The byte-level test vocabulary and HF-directory save/load, against transformers."""

from __future__ import annotations

import json
import random

import pytest

from asyncpp.tokenizer import Tokenizer, load_tokenizer

TEXTS = ["", "plain ascii", "héllo wörld", "世界 🤗 👩‍👩‍👧", "tabs\t\tnew\nlines  ",
         "<s>literal specials</s>", "<|im_start|>user", "\x00\x7f\u00ad\uffff\U0010ffff"]


def _random_unicode(rng: random.Random, num_chars: int) -> str:
    # Any code point except surrogates (not encodable as UTF-8).
    chars = []
    while len(chars) < num_chars:
        code_point = rng.choice([rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x110000)])
        if not 0xD800 <= code_point <= 0xDFFF:
            chars.append(chr(code_point))
    return "".join(chars)


def test_id_layout() -> None:
    tok = Tokenizer.byte_level(300)
    assert tok.vocab_size == 300
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.all_special_ids == frozenset({0, 1, 2})
    assert tok.add_bos_token is True
    assert tok.encode("A\x00\xff", add_special_tokens=False) == [
        3 + 0x41, 3 + 0x00, 3 + 0xC3, 3 + 0xBF]  # U+00FF is two UTF-8 bytes
    assert tok.encode("hi") == [1, 3 + ord("h"), 3 + ord("i")]
    assert tok.convert_ids_to_tokens([0, 1, 2, 259, 299]) == [
        "<unk>", "<s>", "</s>", "<extra_0>", "<extra_40>"]
    assert tok.decode([1, 259, 3 + ord("a"), 2]) == "<extra_0>a"  # filler is visible, specials skipped


def test_smallest_vocab_and_too_small() -> None:
    assert Tokenizer.byte_level(259).vocab_size == 259
    with pytest.raises(ValueError, match="vocab_size must be an int >= 259"):
        Tokenizer.byte_level(258)


def test_round_trips_arbitrary_unicode() -> None:
    tok = Tokenizer.byte_level(512)
    rng = random.Random(0)
    for text in TEXTS + [_random_unicode(rng, 40) for _ in range(50)]:
        ids = tok.encode(text)
        assert ids[0] == 1
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
        if "<s>" not in text:
            assert len(ids) == 1 + len(text.encode("utf-8"))  # one token per byte
            assert tok.decode(ids) == text


def test_saved_dir_loads_same_in_transformers_and_asyncpp(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.byte_level(300)
    tok.save_hf(tmp_path)
    from_file = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    reloaded = Tokenizer.from_hf_dir(tmp_path)
    rng = random.Random(1)
    for text in TEXTS + [_random_unicode(rng, 20) for _ in range(10)]:
        ids = tok.encode(text)
        assert from_file.encode(text) == ids
        assert auto.encode(text) == ids
        assert reloaded.encode(text) == ids
        assert auto.decode(ids, skip_special_tokens=True) == tok.decode(ids) == reloaded.decode(ids)
    assert (auto.bos_token_id, auto.eos_token_id) == (1, 2)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.add_bos_token) == (1, 2, True)
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(messages) == auto.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(messages)


def test_random_source_and_chat_template() -> None:
    tok = load_tokenizer("random", None, vocab_size=260)
    assert tok.vocab_size == 260
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode(prompt)) == prompt


def test_hf_dir_variants_load_like_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    Tokenizer.byte_level(300).save_hf(tmp_path)
    # No BOS post-processor although the config says add_bos_token (tokenizer.json
    # wins); special tokens as AddedToken dicts; the template in its own file.
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False,
                           "normalized": False, "single_word": False, "special": True}
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")

    tok = Tokenizer.from_hf_dir(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.add_bos_token is False
    assert tok.bos_token_id == auto.bos_token_id == 1
    for text in TEXTS:
        assert tok.encode(text) == auto.encode(text)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "<s>x" == auto.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_hf_dir_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        Tokenizer.from_hf_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a valid tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)

    Tokenizer.byte_level(300).save_hf(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<nope>"}')
    with pytest.raises(ValueError, match="tokenizer_config.json: special token '<nope>'"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="tokenizer_config.json: expected a JSON object"):
        Tokenizer.from_hf_dir(tmp_path)

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders
    backend = RustTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.decoder = decoders.Metaspace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="decoder Metaspace is not supported"):
        Tokenizer.from_hf_dir(tmp_path)
