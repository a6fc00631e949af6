"""Validate a request and turn its prompt into token ids, touching no engine state.

A prompt is a string (completion), a list of token ids, or a list of chat
messages (`{"role": ..., "content": ...}`), which go through the chat
template. Every rejection is an `InvalidRequestError` naming the field.
A text far too long to fit `max_model_len` is refused by its length before
it is tokenized, which for megabytes of text would take seconds (and memory),
and a chat with more messages than `max_model_len` tokens can hold is refused
by their number before the chat template runs (`check_chat_size`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams

if TYPE_CHECKING:
    from asyncpp.structured.compiler import GrammarCompiler

Prompt = str | list[int] | list[dict[str, Any]]

# Prompts that cost more than this many characters to tokenize (a text's, or a chat's contents plus
# MESSAGE_CHARS a message) are tokenized on an executor thread, off the serving loop (the engine's
# client port, the HTTP front end).
OFF_LOOP_TOKENIZE_CHARS = 20000
# What one chat message costs beside its content, counted as characters: its role and the template's
# markup around it ("<|im_start|>user\n...<|im_end|>\n"), rendered and then tokenized.
MESSAGE_CHARS = 32
# The roles whose cost the chat template is probed for (see `InputProcessor.check_chat_size`).
PROBED_ROLES = ("system", "user", "assistant", "tool", "developer")
_NUM_PROBE_MESSAGES = 8


def tokenizes_off_loop(prompt: Any) -> bool:
    """Whether tokenizing `prompt` is slow enough to run off the loop. Cheap whatever the prompt:
    a chat of more than OFF_LOOP_TOKENIZE_CHARS / MESSAGE_CHARS messages is not looked into."""
    if isinstance(prompt, str):
        return len(prompt) > OFF_LOOP_TOKENIZE_CHARS
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], dict):
        return False  # token ids need no tokenizing; anything else is refused as it is
    num_chars = MESSAGE_CHARS * len(prompt)
    if num_chars <= OFF_LOOP_TOKENIZE_CHARS:  # (past it, the number of messages is enough to know)
        num_chars += sum(len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    return num_chars > OFF_LOOP_TOKENIZE_CHARS


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._max_text_chars: int | None = None  # see `check_text_length`
        self._costly_roles: frozenset[str] | None = None  # see `check_chat_size`
        self._grammars: GrammarCompiler | None = None  # built for the first request with structured output

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
        if params.structured_outputs is not None:  # its schema or grammar compiles (cached), or a 400
            self.grammars.check(params.structured_outputs)

    def grammar_stats(self) -> dict[str, Any]:
        """The grammar compiler's counts (nothing before the first structured request)."""
        return self._grammars.stats() if self._grammars is not None else {}

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            from asyncpp.structured.compiler import GrammarCompiler  # llguidance: only once a request needs it

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    def tokenize(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids (a chat gets the template); `InvalidRequestError` if unusable."""
        return self._tokenize(prompt, tools)

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

    def check_chat_size(self, messages: Sequence[Any], role_aliases: Mapping[str, str] | None = None) -> None:
        """Refuse a chat with more messages than `max_model_len` tokens can hold, before its template runs.

        Each message of a role the template is seen to render (`costly_roles`) adds at least one token;
        messages of other roles, and anything but a dict, count for nothing. `role_aliases` renames
        roles first (the HTTP server sends "developer" as "system"). O(1) for a chat of at most
        `max_model_len` messages."""
        if len(messages) <= self.max_model_len:
            return
        costly, aliases = self.costly_roles(), role_aliases or {}
        roles = (m.get("role") for m in messages if isinstance(m, dict))
        num_costly = sum(1 for role in roles if isinstance(role, str) and aliases.get(role, role) in costly)
        if num_costly > self.max_model_len:
            raise InvalidRequestError(
                "messages",
                f"messages ({len(messages)}) are more than max_model_len {self.max_model_len} tokens can hold, "
                "at least one token each",
            )

    def costly_roles(self) -> frozenset[str]:
        """The roles of PROBED_ROLES of which the chat template renders every message, even an empty
        one, as at least one token: _NUM_PROBE_MESSAGES empty messages of the role after a user's
        must add at least as many tokens. A role the template drops, merges for free or refuses
        (it raises) is left out, so that the bound never refuses a chat that fits."""
        if self._costly_roles is None:
            first = [{"role": "user", "content": "hi"}]
            base = self._num_template_tokens(first)
            costly = set()
            for role in PROBED_ROLES:
                num = self._num_template_tokens(first + [{"role": role, "content": ""}] * _NUM_PROBE_MESSAGES)
                if base is not None and num is not None and num - base >= _NUM_PROBE_MESSAGES:
                    costly.add(role)
            self._costly_roles = frozenset(costly)
        return self._costly_roles

    def _num_template_tokens(self, messages: list[dict[str, str]]) -> int | None:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError:  # no template, or one that refuses these messages
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _tokenize(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
            self.check_text_length(prompt, "prompt")
            ids = _encode(self.tokenizer, prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            self.check_chat_size(prompt)
            try:
                extra = {"tools": tools} if tools is not None else {}  # for templates that take them
                text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **extra)
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
