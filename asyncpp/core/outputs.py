"""What the scheduler reports: `RequestUpdate` per request per step, `SchedulerStats`.

A `RequestUpdate` is produced for each request that got new tokens or
finished in a step; the engine turns it into streamed output (detokenize,
stop strings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class RequestUpdate(NamedTuple):
    """Immutable; a named tuple, not a frozen dataclass: one is built per request per step, and
    a tuple of four builds in half the time (it never crosses the wire)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # RequestStatus.finish_reason; None while still running
    stop_reason: int | None  # the stop token id that ended it, else None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics and logs."""

    num_running: int
    num_waiting: int
    num_in_flight_steps: int
    kv_usage: float  # fraction of KV blocks owned by requests
    num_preemptions: int  # total since start
    num_prefix_cache_queries_tokens: int  # total since start
    num_prefix_cache_hit_tokens: int  # total since start
    num_waiting_for_remote_kvs: int = 0  # requests whose KV a connector is loading
    num_external_prefix_hit_tokens: int = 0  # total since start: loaded by the KV connector
    num_failed_load_tokens: int = 0  # total since start: the connector failed to load them; recomputed
    # Speculative decoding, totals since start (vLLM's spec_decode_* counters): requests' steps that
    # verified drafts, the draft tokens verified, those accepted, and accepted ones per draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
