"""What the engine reports per request: streamed deltas and the final completion."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncpp.fast_frozen import fast_init
from asyncpp.worker.outputs import Logprobs


@fast_init
@dataclass(frozen=True)
class RequestOutput:
    """One streamed delta of a request: text and tokens new since the previous delta."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string
    logprobs: list[Logprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # with the last delta: for a remote engine
    error: str | None = None


@dataclass
class Completion:
    """A whole request's result, accumulated from its deltas by `Engine.generate`."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # why it failed (finish_reason "error")
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector, once finished

    def add(self, delta: RequestOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason, self.stop_reason, self.error = delta.finish_reason, delta.stop_reason, delta.error
            self.kv_transfer_params = delta.kv_transfer_params
