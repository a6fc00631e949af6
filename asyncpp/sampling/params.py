"""`SamplingParams`: what a request asks of the sampler and of stop checks.

Names and defaults follow vLLM so users can carry their habits over:
`temperature == 0` means greedy; `top_k` of 0 or -1 disables top-k.
`validate` raises `InvalidRequestError` (a `ValueError`) whose `field` is the
offending parameter and whose message starts with its name; it never mutates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.structured import StructuredOutputs

_GREEDY_EPS = 1e-5
# Seen logits are divided or multiplied by the penalty in float32: within this range they stay finite.
_REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# vLLM sets no bound; every stop string is looked for after every token of the request, in the engine's loop.
MAX_STOP_STRINGS = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    include_stop_str_in_output: bool = False
    # Generate only what a JSON schema, regex, choice or grammar allows (`asyncpp.structured`).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers / the wire, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        elif not isinstance(self.stop, tuple):
            raise InvalidRequestError("stop", f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        elif not isinstance(self.stop_token_ids, tuple):
            kind = type(self.stop_token_ids).__name__
            raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be a list of integers, got {kind}")
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputs.from_dict(self.structured_outputs))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError` naming the first bad field."""
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise _bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise _bad("top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise _bad("seed", f"must be in [0, 2**63), got {self.seed}")
        _check_number("repetition_penalty", self.repetition_penalty)
        low, high = _REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise _bad("repetition_penalty", f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise _bad(name, f"must be in [-2, 2], got {value}")
        check_list_lengths(len(self.stop), len(self.stop_token_ids), vocab_size)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", f"must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise _bad("stop_token_ids", f"entry {t} is outside the vocabulary [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", f"must be a bool, got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= 20:
                raise _bad("logprobs", f"must be in [0, 20], got {self.logprobs}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a plain dict (wire or user), rejecting unknown keys by name."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling_params must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)


def _bad(name: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(name, f"{name} {why}")


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {type(value).__name__}")


def _check_number(name: str, value: Any) -> None:
    # Infinity passes every range check below and turns the sampler's arithmetic into NaN.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"must be a finite number, got {value!r}")


def check_list_lengths(num_stop: int, num_stop_token_ids: int, vocab_size: int | None = None) -> None:
    """The lists a request carries, bounded by their lengths alone (so that a front end can refuse a
    million of them before it looks at each): every stop string is looked for after every token, and
    more stop token ids than the vocabulary has tokens can only repeat some."""
    if num_stop > MAX_STOP_STRINGS:
        raise _bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {num_stop}")
    if vocab_size is not None and num_stop_token_ids > vocab_size:
        raise _bad("stop_token_ids", f"must hold at most {vocab_size} entries (the vocabulary's size), got {num_stop_token_ids}")
