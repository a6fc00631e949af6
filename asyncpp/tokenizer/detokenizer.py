"""`IncrementalDetokenizer`: stream a request's output text and find stop strings.

Contract, for the output token ids fed so far through `add_tokens` (and
`flush` at the end):
  * the concatenation of every emitted text equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)`, cut before the
    first stop string (kept when `include_stop_str_in_output`) -- exactly;
  * no text ever ends in half a UTF-8 character: incomplete bytes are held
    until the character completes (or `flush` turns them into U+FFFD, as
    `decode` would);
  * a stop string split across tokens is found: text that could be the start
    of a stop string (at most `max(len(stop)) - 1` chars) is held back;
  * the "first" stop string is the one that completes first in the text
    (earliest end, then earliest start), so results do not depend on how
    tokens are batched into calls;
  * once a stop string is found `stop_string` is set and `add_tokens` raises;
    `flush` then returns "".

Why bytes instead of re-decoding a window of tokens (vLLM's prefix/read
offsets): every tokenizer we load is byte-level, so each id maps to fixed
bytes (`Tokenizer.token_bytes_by_id`) and decoding is "concatenate bytes,
UTF-8 decode with replacement". The stdlib incremental UTF-8 decoder then
holds partial characters exactly, costs O(new bytes) per call, and has no
unbounded window when a model emits invalid bytes. The prompt does not affect
a byte-level decode, so `prompt_token_ids` is accepted for the engine's call
shape but not used as context.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import NamedTuple

from asyncpp.tokenizer.tokenizer import Tokenizer


class DetokenizerDelta(NamedTuple):
    """Immutable; a named tuple, not a frozen dataclass: one is built per token of every request,
    and a tuple builds in half the time."""

    text: str  # newly final text; may be "" while bytes or a possible stop prefix are held
    stop_string: str | None  # the stop string that ended the request, if one did now


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty str, got {stop!r}")
        self._bytes_by_id = tokenizer.token_bytes_by_id(skip_special_tokens)  # ids decode drops are absent
        self._stops = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._pending_bytes = b""  # the start of a UTF-8 character whose other bytes are to come
        self._held_text = ""  # decoded, not yet emitted: could begin a stop string
        self._emitted: list[str] = []
        self._is_finished = False
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def add_tokens(self, new_token_ids: Sequence[int]) -> DetokenizerDelta:
        if self.stop_string is not None:
            raise RuntimeError(f"detokenizer already stopped at stop string {self.stop_string!r}")
        if self._is_finished:
            raise RuntimeError("detokenizer was flushed; the request is finished")
        bytes_of = self._bytes_by_id.get
        if len(new_token_ids) == 1:  # a decode step: skip the join
            new_bytes = bytes_of(new_token_ids[0], b"")
        else:
            new_bytes = b"".join([bytes_of(token_id, b"") for token_id in new_token_ids])
        new_text = self._decode(new_bytes, final=False)
        if not self._stops:  # nothing to look for or hold back: all of it is final
            self._emitted.append(new_text)
            return DetokenizerDelta(new_text, None)
        return self._emit(new_text, is_final=False)

    def add_tokens_until_stop(self, new_token_ids: Sequence[int]) -> tuple[DetokenizerDelta, int]:
        """Like `add_tokens`, one token at a time, stopping at the token that completes a stop string.
        Returns the delta and how many of `new_token_ids` it took (the rest come after the stop)."""
        if len(new_token_ids) <= 1 or not self._stops:
            return self.add_tokens(new_token_ids), len(new_token_ids)
        texts = []
        for i, token_id in enumerate(new_token_ids):
            delta = self.add_tokens([token_id])
            texts.append(delta.text)
            if delta.stop_string is not None:
                return DetokenizerDelta("".join(texts), delta.stop_string), i + 1
        return DetokenizerDelta("".join(texts), None), len(new_token_ids)

    def flush(self) -> str:
        """Release held text when the request ends without a stop string."""
        if self._is_finished or self.stop_string is not None:
            return ""
        self._is_finished = True
        return self._emit(self._decode(b"", final=True), is_final=True).text

    def _decode(self, new_bytes: bytes, final: bool) -> str:
        """What `codecs`' incremental UTF-8 decoder (errors="replace") does, without its Python frame."""
        data = self._pending_bytes + new_bytes if self._pending_bytes else new_bytes
        text, num_consumed = codecs.utf_8_decode(data, "replace", final)
        self._pending_bytes = data[num_consumed:]
        return text

    def _emit(self, new_text: str, *, is_final: bool) -> DetokenizerDelta:
        # Invariant: a stop string that ends in `new_text` starts within
        # `_held_text` + `new_text`, because we never emit a suffix that is a
        # prefix of a stop string.
        buffer = self._held_text + new_text
        found = self._find_first_stop(buffer)
        if found is not None:
            start, stop = found
            text = buffer[:start + len(stop)] if self._include_stop else buffer[:start]
            self._held_text = ""
            self.stop_string = stop
            self._emitted.append(text)
            return DetokenizerDelta(text, stop)
        num_held = 0 if is_final else self._num_chars_to_hold(buffer)
        text, self._held_text = buffer[:len(buffer) - num_held], buffer[len(buffer) - num_held:]
        self._emitted.append(text)
        return DetokenizerDelta(text, None)

    def _find_first_stop(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_chars_to_hold(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that begins some stop string."""
        for num_chars in range(min(len(buffer), self._max_stop_len - 1), 0, -1):
            suffix = buffer[-num_chars:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return num_chars
        return 0
