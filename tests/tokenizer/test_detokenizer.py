"""IncrementalDetokenizer: exact text, whole characters, stop strings across tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from asyncpp.tokenizer import IncrementalDetokenizer, Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer.byte_level(300)


def _reference(text: str, stops: Sequence[str], include_stop: bool) -> tuple[str, str | None]:
    """`text` cut at the stop string that completes first (longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include_stop else text[:end - len(stop)]), stop
    return text, None


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None,
            ) -> list[str]:
    """Feed `ids` one at a time (or in random chunks, empty ones too) until a stop; flush."""
    deltas = []
    pos = 0
    while pos < len(ids) and detok.stop_string is None:
        size = 1 if rng is None else rng.randint(0, 4)
        delta = detok.add_tokens(ids[pos:pos + size])
        pos += size
        deltas.append(delta.text)
        assert (delta.stop_string is not None) == (detok.stop_string is not None)
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.output_text
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_real_vocab_ids_equal_decode(smollm: Tokenizer, skip_special_tokens: bool) -> None:
    # Random ids include specials and tokens that are fragments of UTF-8 characters.
    rng = random.Random(0)
    for _ in range(150):
        ids = [rng.randrange(smollm.vocab_size) if rng.random() < 0.8 else rng.randrange(17)
               for _ in range(rng.randint(0, 25))]
        detok = IncrementalDetokenizer(smollm, [], skip_special_tokens=skip_special_tokens)
        text = "".join(_stream(detok, ids, rng))
        assert text == smollm.decode(ids, skip_special_tokens=skip_special_tokens)


def test_random_bytes_equal_decode(byte_tok: Tokenizer) -> None:
    # Every id is one raw byte: mostly invalid UTF-8, which must match decode's U+FFFD exactly.
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(300), 3 + rng.randrange(0x80, 0x100)])
               for _ in range(rng.randint(0, 12))]
        detok = IncrementalDetokenizer(byte_tok, [])
        assert "".join(_stream(detok, ids, rng)) == byte_tok.decode(ids)


@pytest.mark.parametrize("text", ["世界 🤗 ok", "naïve 👩‍👩‍👧 family", "中文字符，还有한국어"])
def test_split_characters_are_held_until_complete(smollm: Tokenizer, byte_tok: Tokenizer,
                                                   text: str) -> None:
    for tok in (smollm, byte_tok):
        ids = tok.encode(text, add_special_tokens=False)
        # The test needs characters split across tokens to mean anything.
        assert any(REPLACEMENT in tok.decode([i]) for i in ids)
        deltas = _stream(IncrementalDetokenizer(tok, []), ids)
        assert all(REPLACEMENT not in d for d in deltas)
        assert "".join(deltas) == text


def test_flush_turns_incomplete_bytes_into_replacement(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("a🤗", add_special_tokens=False)[:-1]  # emoji missing its last byte
    detok = IncrementalDetokenizer(byte_tok, [])
    assert detok.add_tokens(ids).text == "a"
    assert detok.flush() == REPLACEMENT == byte_tok.decode(ids)[1:]
    assert detok.flush() == ""  # idempotent
    with pytest.raises(RuntimeError, match="flushed"):
        detok.add_tokens([5])


PARIS = "The capital of France is Paris. It is big."


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(smollm: Tokenizer, include: bool) -> None:
    ids = smollm.encode(PARIS)
    assert all("Paris." not in smollm.decode([i]) for i in ids)  # it really is split
    detok = IncrementalDetokenizer(smollm, ids[:3], stop=("Paris.",), include_stop_str_in_output=include)
    deltas = []
    for token_id in ids:
        delta = detok.add_tokens([token_id])
        deltas.append(delta.text)
        if delta.stop_string is not None:
            break
    assert detok.stop_string == "Paris."
    expected = "The capital of France is Paris." if include else "The capital of France is "
    assert "".join(deltas) == detok.output_text == expected
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match="already stopped"):
        detok.add_tokens([ids[-1]])


@pytest.mark.parametrize("stops", [("France", "capital of", "is big"), ("Paris. It", "is Paris"),
                                   ("Paris", "Paris. It is"), ("big.", "e")])
@pytest.mark.parametrize("include", [False, True])
def test_first_completed_stop_wins_however_tokens_are_batched(smollm: Tokenizer, stops, include) -> None:
    ids = smollm.encode(PARIS)
    expected = _reference(PARIS, stops, include)
    one_by_one = IncrementalDetokenizer(smollm, [], stop=stops, include_stop_str_in_output=include)
    _stream(one_by_one, ids)
    all_at_once = IncrementalDetokenizer(smollm, [], stop=stops, include_stop_str_in_output=include)
    delta = all_at_once.add_tokens(ids)
    assert (one_by_one.output_text, one_by_one.stop_string) == expected
    assert (delta.text, delta.stop_string) == expected


def test_possible_stop_prefix_is_held_then_released(smollm: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm, [], stop=("Paris!",))
    texts = [detok.add_tokens([i]).text for i in smollm.encode("I love Paris")]
    assert "".join(texts) == "I love "  # " Paris" could still become "Paris!"
    assert detok.flush() == "Paris"
    assert detok.stop_string is None
    assert detok.output_text == "I love Paris"

    # A prefix that turns out not to be a stop is released when the next text arrives.
    detok = IncrementalDetokenizer(smollm, [], stop=("Paris!",))
    texts = [detok.add_tokens([i]).text for i in smollm.encode("Paris, then Rome")]
    assert "".join(texts) == "Paris, then Rome"
    assert detok.flush() == ""


def test_random_texts_and_stops_match_reference(byte_tok: Tokenizer) -> None:
    rng = random.Random(2)
    alphabet = "ab é世🤗"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 15)))
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3)))
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(byte_tok, [1], stop=stops, include_stop_str_in_output=include)
        ids = byte_tok.encode(text, add_special_tokens=False)
        deltas = _stream(detok, ids, rng)
        assert ("".join(deltas), detok.stop_string) == _reference(text, stops, include)
        assert all(REPLACEMENT not in d for d in deltas)


def test_special_tokens_skipped_or_kept(smollm: Tokenizer) -> None:
    ids = smollm.encode("<|im_start|>assistant\nHi<|im_end|>")
    skipped = IncrementalDetokenizer(smollm, [])
    kept = IncrementalDetokenizer(smollm, [], skip_special_tokens=False, stop=("<|im_end|>",))
    assert "".join(_stream(skipped, ids)) == "assistant\nHi"
    _stream(kept, ids)
    assert (kept.output_text, kept.stop_string) == ("<|im_start|>assistant\nHi", "<|im_end|>")


def test_out_of_range_ids_are_dropped_like_decode(byte_tok: Tokenizer) -> None:
    ids = [3 + ord("a"), 10_000, 3 + ord("b")]
    assert "".join(_stream(IncrementalDetokenizer(byte_tok, []), ids)) == byte_tok.decode(ids) == "ab"


@pytest.mark.parametrize("stop", [("",), ("ok", "")])
def test_empty_stop_string_rejected(byte_tok: Tokenizer, stop) -> None:
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        IncrementalDetokenizer(byte_tok, [], stop=stop)
