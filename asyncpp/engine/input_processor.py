"""Validate a request and turn its prompt into token ids, touching no engine state.

A prompt is a string (completion), a list of token ids, or a list of chat
messages (`{"role": ..., "content": ...}`), which go through the chat
template. Every rejection is an `InvalidRequestError` naming the field.
"""

from __future__ import annotations

from typing import Any

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams

Prompt = str | list[int] | list[dict[str, Any]]


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        try:
            params.validate(self.vocab_size)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError("sampling_params", str(e)) from e
        prompt_token_ids = self._tokenize(prompt)
        self._check_lengths(len(prompt_token_ids), params.max_tokens)
        return prompt_token_ids

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (a chat gets the template); `InvalidRequestError` if unusable."""
        return self._tokenize(prompt)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            try:
                text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            except ValueError as e:
                raise InvalidRequestError("messages", str(e)) from e
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, list):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
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

    def _check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
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
