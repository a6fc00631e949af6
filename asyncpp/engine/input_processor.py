"""Validate a request and turn its prompt into token ids, touching no engine state.

A prompt is a string (completion), a list of token ids, or a list of chat
messages (`{"role": ..., "content": ...}`), which go through the chat
template. Every rejection is an `InvalidRequestError` naming the field.
A text far too long to fit `max_model_len` is refused by its length before
it is tokenized, which for megabytes of text would take seconds (and memory).
"""

from __future__ import annotations

from typing import Any

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams

Prompt = str | list[int] | list[dict[str, Any]]

# Prompts with more characters than this to tokenize (a text's, or a chat's contents') are tokenized
# on an executor thread, off the serving loop (the engine's client port, the HTTP front end).
OFF_LOOP_TOKENIZE_CHARS = 20000


def tokenizes_off_loop(prompt: Any) -> bool:
    """Whether tokenizing `prompt` is slow enough to run off the loop."""
    if isinstance(prompt, str):
        num_chars = len(prompt)
    elif isinstance(prompt, list):
        num_chars = sum(len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    else:
        num_chars = 0
    return num_chars > OFF_LOOP_TOKENIZE_CHARS


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._max_text_chars: int | None = None  # see `check_text_length`

    def process(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        self.validate(params)
        prompt_token_ids = self._tokenize(prompt)
        self.check_lengths(len(prompt_token_ids), params.max_tokens)
        return prompt_token_ids

    def validate(self, params: SamplingParams) -> None:
        """`InvalidRequestError` naming the first bad sampling parameter."""
        try:
            params.validate(self.vocab_size)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as e:
            raise InvalidRequestError("sampling_params", str(e)) from e

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (a chat gets the template); `InvalidRequestError` if unusable."""
        return self._tokenize(prompt)

    def check_text_length(self, text: str, field: str = "prompt") -> None:
        """Refuse a text that cannot fit `max_model_len` tokens whatever its tokens, without tokenizing it.

        No token spells more than the longest entry of the vocabulary, so a text needs at least
        len(utf-8 bytes) / longest tokens; characters are at least one byte each. The bound is
        taken twice over, so that a normalizing tokenizer never has a fitting text refused."""
        if len(text) <= self.max_model_len:
            return
        if self._max_text_chars is None:
            longest = max((len(b) for b in self.tokenizer.token_bytes_table()), default=1)
            self._max_text_chars = 2 * self.max_model_len * max(1, longest)
        if len(text) > self._max_text_chars:
            raise InvalidRequestError(
                field, f"{field} of {len(text)} characters is longer than max_model_len {self.max_model_len} can hold"
            )

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
            self.check_text_length(prompt, "prompt")
            ids = _encode(self.tokenizer, prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            try:
                text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            except ValueError as e:
                raise InvalidRequestError("messages", str(e)) from e
            self.check_text_length(text, "messages")
            ids = _encode(self.tokenizer, text, "messages", add_special_tokens=False)
        elif isinstance(prompt, list):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
            self.check_lengths(len(prompt), 0)  # before looking at every one of a million ids
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("prompt_token_ids", "must be a list of integers or of chat messages")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    "prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
            ids = list(prompt)
        else:
            raise InvalidRequestError("prompt", f"must be a string, token ids or chat messages, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt", "prompt is empty after tokenization")
        return ids

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """`InvalidRequestError` unless the prompt and its answer fit `max_model_len`."""
        if num_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"prompt has {num_prompt_tokens} tokens, longer than max_model_len {self.max_model_len}"
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len {self.max_model_len}",
            )


def _encode(tokenizer: Any, text: str, field: str, **kwargs: Any) -> list[int]:
    try:
        return tokenizer.encode(text, **kwargs)
    except TypeError:  # the tokenizer takes only valid Unicode: name a lone surrogate ("\ud800")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(field, f"{field} is not valid Unicode: {e.reason}") from e
        raise
