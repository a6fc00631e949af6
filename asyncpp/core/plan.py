"""`StepPlan`: one scheduled step, the only thing the runner needs to run it.

The same plan goes to every pipeline stage, with the KV connector's
metadata for the step. A plan may schedule no request at all: it then only
carries connector metadata (or polls the connector). It is a fresh immutable batch:
the runner keeps per-request sampling state (keyed by request id) and nothing
else across steps, so a plan names every token and block it touches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncpp.fast_frozen import fast_init
from asyncpp.kv_transfer.metadata import KVConnectorMetadata
from asyncpp.sampling.params import SamplingParams

# Stands for a token that the plan named by `StepPlan.after_step_id` samples (async scheduling).
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class NewRequestData:
    """Sent the first step a request is scheduled, and again after a preemption."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before a preemption; [] when new
    sampling_params: SamplingParams


@fast_init
@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step (a prefill chunk, a decode token and its drafts, or a placeholder)
    start_position: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # the whole block table, covering start_position + len(token_ids)
    do_sample: bool  # this step reaches the last known token: sample the next one
    # The last this many of `token_ids` are drafts (speculative decoding): each gets a logits row,
    # and the last stage keeps the ones the target model agrees with, then samples one more.
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@fast_init
@dataclass(frozen=True)
class StepPlan:
    step_id: int
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # runner drops their state
    # Placeholder tokens are the ones this earlier plan samples for the same requests; the
    # first stage waits for them. None: every token is known.
    after_step_id: int | None = None
    # Requests preempted while building this plan: their blocks may be reused by it, so each
    # stage lets their KV transfers finish before running it.
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: KVConnectorMetadata | None = None  # None: no connector
    # Torch threads every stage runs this step with; 0 = its own `parallel.num_threads`. The
    # engine lends a lone cohort's steps the idle stages' threads (they run one at a time).
    num_threads: int = 0
    # Where each stage after the first starts this step (`parallel.shift_layers`: the engine
    # evens out the stages' work per step); () = the static split.
    layer_bounds: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def num_draft_tokens(self) -> int:
        return sum(r.num_draft_tokens for r in self.scheduled)

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
