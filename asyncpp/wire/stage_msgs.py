"""Engine <-> stage channel: start-up info, ready-acks, step plans, stage outputs.

The plan channel carries `StepPlan` itself (registered here) and
`Shutdown`; stages answer with `StageReady` once, `StageHandshake` once
their runner is built (after `StageStart`), and a `StageOutput` for
every step. A stage that fails a step sends `StageOutput` with `error` set.
With async scheduling the last stage also sends the first one
`SampledTokens` after every step, failed or not (on the ring path with the
tokens left in stage 0's token ring: `asyncpp.transport.token_ring`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncpp.core.plan import StepPlan
from asyncpp.kv_transfer.handshake import KVHandshakeMetadata
from asyncpp.transport.base import RingSpec
from asyncpp.wire.codec import message
from asyncpp.worker.outputs import ModelRunnerOutput
from asyncpp.worker.shared_kv import SharedKVSpec

message("step_plan")(StepPlan)


@message("stage_ready")
@dataclass(frozen=True)
class StageReady:
    pp_rank: int
    pid: int
    start_layer: int
    end_layer: int
    num_kv_blocks: int  # what this stage's budget holds; the engine uses the smallest
    recv_ring: RingSpec | None  # None on stage 0 (it receives token ids, not activations)
    load_time_s: float
    weight_nbytes: int  # resident bytes of this stage's weights (packed copies included), for stats
    token_ring: RingSpec | None = None  # stage 0 with the ring path: where the last stage writes tokens


@message("stage_start")
@dataclass(frozen=True)
class StageStart:
    """Engine -> stage after every stage is ready: the agreed block count and the peer ring."""

    num_kv_blocks: int
    send_ring: RingSpec | None  # the next stage's ring; None on the last stage
    # The KV caches of layers held with a neighbour (`parallel.shift_layers`): every window's
    # segment; a stage maps those within its layers.
    shared_kv: list[SharedKVSpec] = field(default_factory=list)
    token_ring: RingSpec | None = None  # the last stage, ring path: stage 0's token ring


@message("stage_handshake")
@dataclass(frozen=True)
class StageHandshake:
    """Stage -> engine once its runner (and KV connector) is built, before the first plan."""

    pp_rank: int
    tp_rank: int = 0
    metadata: KVHandshakeMetadata | None = None  # None: its connector publishes nothing


@message("stage_output")
@dataclass(frozen=True)
class StageOutput:
    step_id: int
    pp_rank: int
    output: ModelRunnerOutput = field(default_factory=ModelRunnerOutput)
    busy_s: float = 0.0  # time this stage spent computing the step
    handoff_us: float = 0.0  # time to write the activations into the next stage's slot
    error: str | None = None


@message("shutdown")
@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@message("sampled_tokens")
@dataclass(frozen=True)
class SampledTokens:
    """Last stage -> first stage (async scheduling): what a step sampled, for later placeholders."""

    step_id: int
    req_ids: list[str] = field(default_factory=list)  # empty when the step sampled nothing or failed
    token_ids: list[int] = field(default_factory=list)  # each request's latest
    # Speculative decoding: each request's drafts for its next step (a continuation verifies them).
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # The ring path (`asyncpp.transport.token_ring`): the tokens are in this slot of the first
    # stage's token ring, one per request of `req_ids`, and `token_ids` is empty; -1: host path.
    slot: int = -1
