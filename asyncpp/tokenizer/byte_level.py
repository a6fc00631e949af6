"""A merge-free byte-level vocabulary for tiny random test models.

Id layout (stable; tests and saved tiny models rely on it):
    0            `<unk>`   special (never produced: every byte has a token)
    1            `<s>`     special, BOS, prepended by `encode`
    2            `</s>`    special, EOS
    3 + b        byte b (0..255), spelled in GPT-2's byte alphabet
    259 ..       `<extra_0>`, `<extra_1>`, ... unused filler up to `vocab_size`

Filler tokens pad the vocabulary to the model's size. They are plain vocabulary
entries, not added tokens: `encode` never produces them, and `decode` shows a
sampled one as its name, so a random model's output stays visible.

With no merges every UTF-8 byte is one token, so any text round-trips. The
chat template is ChatML with `<|im_start|>`/`<|im_end|>` as plain text
(encoded byte by byte), enough for chat requests against tiny models.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, pre_tokenizers

from asyncpp.tokenizer.bpe_backend import BYTE_TO_CHAR, build_bpe_backend

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
FIRST_BYTE_TOKEN_ID = 3
MIN_VOCAB_SIZE = FIRST_BYTE_TOKEN_ID + 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ByteLevelParts:
    backend: Tokenizer
    bos_token_id: int
    eos_token_id: int
    chat_template: str


def build_byte_level(vocab_size: int) -> ByteLevelParts:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"byte-level vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {vocab_size!r}")
    tokens = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]
    tokens += [BYTE_TO_CHAR[b] for b in range(256)]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - MIN_VOCAB_SIZE)]
    backend = build_bpe_backend(
        vocab={token: token_id for token_id, token in enumerate(tokens)},
        merges=[],
        pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        special_tokens=[UNK_TOKEN, BOS_TOKEN, EOS_TOKEN],
        bos_token=BOS_TOKEN,
    )
    return ByteLevelParts(backend, BOS_TOKEN_ID, EOS_TOKEN_ID, CHATML_TEMPLATE)
