"""Client <-> engine channel: requests in, streamed deltas and errors out.

A `GenerateRequest` carries a prompt (text, token ids or chat messages) and
plain sampling parameters; the engine answers with `RequestDelta` frames
until one has `finished`, or an `ErrorReply`. Frames the engine cannot
decode get an `ErrorReply` with `request_id` None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncpp.wire.codec import message
from asyncpp.worker.outputs import Logprobs


@message("generate")
@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt: str | list[int] | list[dict[str, str]]
    sampling_params: dict[str, Any] = field(default_factory=dict)


@message("abort")
@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@message("health")
@dataclass(frozen=True)
class HealthRequest:
    nonce: int = 0


@message("stats")
@dataclass(frozen=True)
class StatsRequest:
    nonce: int = 0


@message("delta")
@dataclass(frozen=True)
class RequestDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@message("error")
@dataclass(frozen=True)
class ErrorReply:
    request_id: str | None
    message: str
    kind: str = "invalid_request"  # invalid_request | bad_frame | engine_dead | internal
    field: str | None = None


@message("health_reply")
@dataclass(frozen=True)
class HealthReply:
    nonce: int
    is_healthy: bool


@message("stats_reply")
@dataclass(frozen=True)
class StatsReply:
    nonce: int
    stats: dict[str, Any]
