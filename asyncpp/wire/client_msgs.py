"""Client <-> engine channel: requests in, streamed deltas and errors out.

A `GenerateRequest` carries a prompt (text, token ids or chat messages) and
plain sampling parameters; the engine answers with `RequestDelta`s until one
has `finished`, or an `ErrorReply`. Deltas travel in `RequestDeltas`
frames: one per client per completed step, carrying every delta of that
step for that client's requests (in step order per request), so a client
with many requests costs one send per step, not one per token. A frame the
engine (or a router) cannot decode gets a "bad_frame" `ErrorReply`
(`bad_frame_reply`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.wire.codec import WireError, message
from asyncpp.worker.outputs import Logprobs


@message("generate")
@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt: str | list[int] | list[dict[str, str]]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    # For the engine's KV connector (prefill/decode disaggregation: where the prompt's KV is).
    kv_transfer_params: dict[str, Any] | None = None


@message("remote_prefill_done")
@dataclass(frozen=True)
class RemotePrefillDone:
    """For a request the engine took awaiting a remote prefill (its `kv_transfer_params` said so):
    the remote engine's params, now that it computed the prompt and sampled the first token. A
    refusal ends the request with an `ErrorReply`; nothing answers an accepted one."""

    request_id: str
    kv_transfer_params: dict[str, Any]


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
    kv_transfer_params: dict[str, Any] | None = None  # with the last delta: for a remote engine


@message("deltas")
@dataclass(frozen=True)
class RequestDeltas:
    """One step's deltas for one client, column by column: entry i of every list is delta i.

    Columns rather than a list of `RequestDelta` maps because this frame goes
    out every step: packing and checking a few lists costs the engine and the
    client far less per token than one nine-key map per delta.
    """

    # One column per `RequestDelta` field, in its order.
    request_ids: list[str]
    texts: list[str]
    token_ids: list[list[int]]
    finished: list[bool]
    finish_reasons: list[str | None]
    stop_reasons: list[int | str | None]
    logprobs: list[list[Logprobs] | None]
    num_prompt_tokens: list[int]
    num_cached_tokens: list[int]
    kv_transfer_params: list[dict[str, Any] | None]

    def __post_init__(self) -> None:
        num_deltas = len(self.request_ids)
        for f in fields(self):
            if len(getattr(self, f.name)) != num_deltas:
                raise ValueError(f"{f.name} has {len(getattr(self, f.name))} entries for {num_deltas} request ids")

    @staticmethod
    def of(deltas: Sequence[Any]) -> RequestDeltas:
        """From `RequestDelta`s, or anything with their fields (the engine's `RequestOutput`s)."""
        return RequestDeltas(*(list(map(get, deltas)) for get in _DELTA_GETTERS))

    def deltas(self) -> list[RequestDelta]:
        return list(map(RequestDelta, *(getattr(self, f.name) for f in fields(self))))


_DELTA_FIELDS = tuple(f.name for f in fields(RequestDelta))
_DELTA_GETTERS = tuple(map(attrgetter, _DELTA_FIELDS))  # a column of a step's deltas in one C-level pass
assert len(_DELTA_FIELDS) == len(fields(RequestDeltas)), "RequestDeltas needs one column per RequestDelta field"


@message("error")
@dataclass(frozen=True)
class ErrorReply:
    request_id: str | None
    message: str
    kind: str = "invalid_request"  # invalid_request | bad_frame | engine_dead | forbidden | internal
    field: str | None = None


def bad_frame_reply(error: WireError, is_live: Callable[[str], bool]) -> ErrorReply:
    """The reply to a frame that does not decode: under the request's own id where its head still
    names a request not in flight (`is_live(id)` false), so that its client's stream ends with it;
    else under none (a live request's client would take the error for that request's end)."""
    request_id = error.request_id if error.tag == GenerateRequest.WIRE_TAG else None
    if request_id is not None and is_live(request_id):
        request_id = None
    return ErrorReply(request_id, str(error), "bad_frame")


@message("health_reply")
@dataclass(frozen=True)
class HealthReply:
    nonce: int
    is_healthy: bool
    kv_generation: int = 0  # its KV connector's (`EngineHandshake.generation`): a new one needs a new handshake


@message("stats_reply")
@dataclass(frozen=True)
class StatsReply:
    nonce: int
    stats: dict[str, Any]


@message("kv_handshake")
@dataclass(frozen=True)
class KVHandshakeRequest:
    """Ask an engine for its KV transfer endpoints (prefill/decode disaggregation)."""

    nonce: int = 0


@message("kv_handshake_reply")
@dataclass(frozen=True)
class KVHandshakeReply:
    nonce: int
    handshake: EngineHandshake | None  # None: the engine's connector publishes none (or refused)
    error: str | None = None  # why it refused (the asker does not hold the engine role)


@message("add_remote_engine")
@dataclass(frozen=True)
class AddRemoteEngine:
    """Tell an engine's KV connector about a remote engine it moves KV with."""

    nonce: int
    handshake: EngineHandshake


@message("add_remote_engine_reply")
@dataclass(frozen=True)
class AddRemoteEngineReply:
    nonce: int
    error: str | None = None  # None: added
