"""`Request`: the engine's per-request state, owned by the scheduler.

Invariant: `num_computed_tokens <= num_tokens`; the KV cache holds exactly the
first `num_computed_tokens` tokens of `all_token_ids`. A request that is part
of a dispatched step (`is_in_flight`) is never scheduled again until that
step's output is back; the pipeline runtime builds disjoint cohorts from this.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from asyncpp.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV blocks freed (recompute)
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
    num_preemptions: int = 0
    is_in_flight: bool = False
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

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
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a decode step wants one token)."""
        num_prompt_tokens = len(self.prompt_token_ids)
        if start >= num_prompt_tokens:
            return self.output_token_ids[start - num_prompt_tokens : end - num_prompt_tokens]
        if end <= num_prompt_tokens:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
