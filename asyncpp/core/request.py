"""`Request`: the engine's per-request state, owned by the scheduler.

Invariant: `num_computed_tokens <= num_tokens + num_placeholders + num_draft_tokens`;
the KV cache holds (or an in-flight plan is writing) the first
`num_computed_tokens` tokens of `all_token_ids` followed by the placeholders or
the drafts being verified. A decoding request is in at most two
dispatched plans (`num_in_flight`): the one it was last scheduled in
(`last_step_id`) and, with async scheduling, the one after it, whose input is
the token that plan samples (a placeholder until its output is back). The
pipeline runtime builds disjoint cohorts from this. A prompt's chunks, which
need no token, may be in more (async scheduling: any plan takes the next one).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from asyncpp.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV blocks freed (recompute)
    # Its blocks are allocated and a KV connector is loading part of its prefix into them on
    # every stage; not scheduled until every stage has reported the load.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.value if self._is_finished else None


# Asked for every request of every step: decided once per member, not by matching its name each time.
for _status in RequestStatus:
    _status._is_finished = _status.name.startswith("FINISHED")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at first schedule
    num_external_tokens: int = 0  # tokens a KV connector supplied (loaded) at first schedule
    num_preemptions: int = 0
    num_in_flight: int = 0  # dispatched plans holding it whose output is not back
    last_step_id: int = -1  # the plan it was last scheduled in
    num_placeholders: int = 0  # tokens scheduled before they were sampled (async scheduling)
    # Speculative decoding: the proposer's guesses at the tokens after the last one, from the
    # request's latest output (never part of its tokens until verified), and how many of them
    # its in-flight plan verifies (their KV is written, then rolled back where rejected).
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # of the plan it was last scheduled in
    # A continuation in flight placed after drafts its plan before did not all accept: dropped when back.
    void_step_id: int | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # From the client, for the KV connector (prefill/decode disaggregation: where the prompt's KV is).
    kv_transfer_params: dict[str, Any] | None = None
    # Its first output token comes from a remote engine that is still computing the prompt (the KV
    # connector loads the prompt's KV meanwhile): nothing of it is computed before that token.
    awaits_remote_tokens: bool = False
    # From the KV connector once finished (`request_finished`): what a remote engine needs to pull
    # its KV; goes out with the request's last delta.
    finished_kv_transfer_params: dict[str, Any] | None = None
    # `all_token_ids`, kept between calls (a block's allocation reads it every step) and extended by
    # the outputs appended since. Output tokens only ever grow, by appending.
    _all_token_ids: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt's tokens, then the outputs. Not a copy: callers must not change it."""
        known = self._all_token_ids
        num_new = len(self.prompt_token_ids) + len(self.output_token_ids) - len(known)
        if num_new > 0 and len(known) >= len(self.prompt_token_ids):
            known += self.output_token_ids[-num_new:]
        elif num_new:  # first call (or outputs replaced, in tests): build it whole
            known[:] = self.prompt_token_ids + self.output_token_ids
        return known

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a decode step wants one token)."""
        num_prompt_tokens = len(self.prompt_token_ids)
        if start >= num_prompt_tokens:
            return self.output_token_ids[start - num_prompt_tokens : end - num_prompt_tokens]
        if end <= num_prompt_tokens:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt_tokens]

    @property
    def is_in_flight(self) -> bool:
        return self.num_in_flight > 0

    @property
    def is_floating(self) -> bool:
        """In flight with known tokens still to compute (a prompt's next chunk): any plan may take
        them (async scheduling), outside its cohort's request cap."""
        return self.num_in_flight > 0 and self.num_computed_tokens < self.num_tokens

    @property
    def is_only_void_in_flight(self) -> bool:
        """Its one plan in flight is a void continuation: it may be scheduled again meanwhile."""
        return self.num_in_flight == 1 and self.void_step_id is not None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
