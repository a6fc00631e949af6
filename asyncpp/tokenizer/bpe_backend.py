"""Assemble a byte-level BPE `tokenizers.Tokenizer` from plain parts.

Contract: `build_bpe_backend` returns a Rust tokenizer that (1) splits added
tokens out of the input first, so `<|im_start|>` in text becomes its single id;
(2) pre-tokenizes with the given pre-tokenizer; (3) runs BPE over the given
vocabulary and merges; (4) prepends BOS when `bos_token` is given; and
(5) decodes with the byte-level decoder. Every builder (GGUF, byte-level test
vocabulary) goes through here so they share one behaviour.

`BYTE_TO_CHAR` is GPT-2's reversible byte -> printable character map, the
spelling in which byte-level vocabularies store their tokens; `token_bytes`
inverts it for one token.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, processors
from tokenizers.pre_tokenizers import PreTokenizer


def _byte_to_char() -> dict[int, str]:
    # Bytes that are printable Latin-1 stand for themselves; the other 68
    # (controls, space, 0x7F-0xA0, 0xAD) are moved, in byte order, to U+0100+
    # so every token is printable and whitespace-free.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    num_moved = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + num_moved)
            num_moved += 1
    return mapping


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()

# str.translate table: alphabet char -> the Latin-1 char of its byte; every
# other char below U+0100 -> U+FFFF, so `encode("latin-1")` fails on any token
# not spelled in the alphabet.
_TO_LATIN1 = str.maketrans({
    **{chr(b): "\uffff" for b in range(256)},
    **{c: chr(b) for b, c in BYTE_TO_CHAR.items()},
})


def token_bytes(token: str) -> bytes:
    """The bytes the byte-level decoder turns `token` into.

    Like the decoder, a token spelled entirely in the byte alphabet maps char
    by char; any other (an added token such as `<think>` written raw with a
    space, say) is taken as its UTF-8 text.
    """
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def build_bpe_backend(
    *,
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    pre_tokenizer: PreTokenizer,
    ignore_merges: bool = False,
    special_tokens: Sequence[str] = (),
    user_tokens: Sequence[str] = (),
    bos_token: str | None = None,
) -> Tokenizer:
    """A byte-level BPE tokenizer; `special_tokens`/`user_tokens` must be in `vocab`."""
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    # normalized=False: match the raw text, as HF and llama.cpp do for added tokens.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special_tokens])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_tokens])
    if bos_token is not None:
        backend.post_processor = bos_post_processor(bos_token, vocab[bos_token])
    return backend


def bos_post_processor(bos_token: str, bos_token_id: int) -> processors.TemplateProcessing:
    """Prepend BOS to each sequence (the Llama-3 layout for pairs)."""
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_token_id)],
    )
