"""What a stage returns for one step: `ModelRunnerOutput`.

Every stage returns one per step, never `None`. Non-last stages sample
nothing and return `ModelRunnerOutput.with_kv_conn_output_only(...)`, which is
the shared empty singleton when the KV connector has nothing to report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from asyncpp.kv_transfer.metadata import KVConnectorOutput


@dataclass(frozen=True)
class Logprobs:
    """Logprobs of one sampled token: its own and the top-N of the raw distribution."""

    token_logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)  # requests that sampled this step
    sampled_token_ids: list[list[int]] = field(default_factory=list)  # [num_reqs][num_sampled]
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)  # None where not asked
    # Speculative decoding: per request that sampled, the proposer's guesses at its next tokens
    # (unverified); empty when no proposer runs.
    draft_token_ids: list[list[int]] = field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None

    @staticmethod
    def with_kv_conn_output_only(kv_connector_output: KVConnectorOutput | None) -> ModelRunnerOutput:
        if kv_connector_output is None or kv_connector_output.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT
        return dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT, kv_connector_output=kv_connector_output)

    def sampled_by_request(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids, strict=True))

    def drafts_by_request(self) -> dict[str, list[int]] | None:
        """Each sampled request's drafts for its next step; None when no proposer ran."""
        if not self.draft_token_ids:
            return None
        return dict(zip(self.req_ids, self.draft_token_ids, strict=True))


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()
