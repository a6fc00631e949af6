"""The real SmolLM2 GGUF tokenizer against transformers and llama.cpp's rules."""

from __future__ import annotations

import pytest

from asyncpp.tokenizer import Tokenizer
from asyncpp.tokenizer.bpe_backend import token_bytes

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, ça va? Ñandú, naïve café",
    "日本語のテキストと中文字符，还有한국어",
    "emoji: 🤗🚀 family 👩‍👩‍👧 flag 🇫🇷 ok",
    "def square(x):\n\treturn x ** 2  # comment\n",
    "multiple   spaces\tand\t\ttabs\n\n\nnewlines\r\nwindows",
    "numbers 12345 and 3.14159, year 2024, -7e10, 1,000,000",
    "abc123def v1.2.3 0x1F",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "trailing spaces   ",
    "   leading spaces",
    "",
    " ",
    "x=[1,2,3]; y={'a': 1} // <tag attr=\"v\">&amp;</tag>",
    "I'm sure they'll say it's fine, we've done what we'd planned.",
]

# SmolLM2's tokenizer.json splits every digit off before GPT-2's regex, so a
# whitespace run before a digit stays one pre-token ("a", "  ", "1").
# transformers' GGUF loader ignores `pre = "smollm"` and differs on these.
WHITESPACE_BEFORE_DIGITS = ["a  1", "x   2024", "  42\n\t7", "col1\t\t2\n  3"]


def test_reports_metadata(smollm: Tokenizer) -> None:
    tok = smollm
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.add_bos_token is False
    assert tok.all_special_ids == frozenset(range(17))  # the 17 control tokens
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", CORPUS)
def test_ids_and_decode_match_transformers(smollm: Tokenizer, hf_smollm, text: str) -> None:
    ids = smollm.encode(text)
    assert ids == hf_smollm.encode(text)
    assert smollm.decode(ids, skip_special_tokens=False) == text
    assert smollm.decode(ids, skip_special_tokens=False) == hf_smollm.decode(ids, skip_special_tokens=False)
    assert smollm.decode(ids) == hf_smollm.decode(ids, skip_special_tokens=True)
    assert smollm.convert_ids_to_tokens(ids) == hf_smollm.convert_ids_to_tokens(ids)


def test_special_token_text_is_one_id(smollm: Tokenizer) -> None:
    assert smollm.encode("<|im_start|>user") == [1, smollm.encode("user")[0]]
    assert smollm.decode([1, 2, 0]) == ""


@pytest.fixture(scope="module")
def tokenizer_json_reference(hf_smollm):
    """transformers' vocabulary and merges with SmolLM2 tokenizer.json's pre-tokenizer."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import pre_tokenizers

    reference = RustTokenizer.from_str(hf_smollm.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return reference


@pytest.mark.parametrize("text", WHITESPACE_BEFORE_DIGITS)
def test_smollm_pre_tokenizer_follows_tokenizer_json(smollm: Tokenizer, tokenizer_json_reference,
                                                     text: str) -> None:
    ids = smollm.encode(text)
    assert ids == tokenizer_json_reference.encode(text).ids
    assert smollm.decode(ids) == text


def _llama_cpp_smollm_split(text: str) -> list[str]:
    regex = pytest.importorskip("regex")
    # llama.cpp (LLAMA_VOCAB_PRE_TYPE_SMOLLM) applies these in turn; each one
    # splits every piece into its matches and the gaps between them.
    pieces = [text]
    for pattern in (r"\p{N}",
                    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"):
        split = []
        for piece in pieces:
            pos = 0
            for match in regex.finditer(pattern, piece):
                split += [piece[pos:match.start()], match.group()]
                pos = match.end()
            split.append(piece[pos:])
        pieces = [p for p in split if p]
    return pieces


# Special tokens are split out before pre-tokenization, so leave those texts out.
PLAIN_TEXTS = [t for t in CORPUS + WHITESPACE_BEFORE_DIGITS if "<|" not in t]


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_pre_tokens_match_llama_cpp_smollm_regexes(smollm: Tokenizer, text: str) -> None:
    ours = smollm._backend.pre_tokenizer.pre_tokenize_str(text)
    # Our pieces are in the byte alphabet; map them back to text to compare.
    assert [token_bytes(piece).decode("utf-8") for piece, _ in ours] == _llama_cpp_smollm_split(text)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi! 👋"}],
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 12345 * 2?\n\tShow work."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm: Tokenizer, hf_smollm, messages,
                                            add_generation_prompt: bool) -> None:
    prompt = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_smollm.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert prompt == expected
    expected_ids = hf_smollm.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
    assert smollm.encode(prompt) == list(expected_ids)
