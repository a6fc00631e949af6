"""`SamplerOutput`: the sampled tokens of one step, plus logprobs where asked.

All tensors are on the CPU. Logprob tensors exist only when at least one row
asked (`params.logprobs is not None`); their rows for requests that did not
ask hold NaN, and columns past a row's own `logprobs` count hold valid but
unrequested entries. The accessors trim to what each request asked for, so
callers should read through them rather than index the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RequestLogprobs:
    """Logprobs for one request at one step, as the API returns them."""

    sampled_logprob: float
    top_token_ids: list[int]  # most likely first; len == the request's `logprobs`
    top_logprobs: list[float]


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: torch.Tensor | None = None  # [num_reqs] float32, of the sampled token
    top_logprob_token_ids: torch.Tensor | None = None  # [num_reqs, max_num_logprobs] int64
    top_logprobs: torch.Tensor | None = None  # [num_reqs, max_num_logprobs] float32
    num_logprobs: torch.Tensor | None = None  # [num_reqs] int64; -1 where not asked

    @property
    def num_reqs(self) -> int:
        return self.sampled_token_ids.shape[0]

    def token_id(self, i: int) -> int:
        return int(self.sampled_token_ids[i])

    def request_logprobs(self, i: int) -> RequestLogprobs | None:
        """Request `i`'s logprobs trimmed to its own count; None if it did not ask."""
        tensors = self._logprob_tensors()
        if tensors is None:
            return None
        num_logprobs, sampled, top_ids, top_values = tensors
        num_top = int(num_logprobs[i])
        if num_top < 0:
            return None
        return RequestLogprobs(
            sampled_logprob=float(sampled[i]),
            top_token_ids=top_ids[i, :num_top].tolist(),
            top_logprobs=top_values[i, :num_top].tolist(),
        )

    def to_lists(self) -> tuple[list[int], list[RequestLogprobs | None]]:
        """All rows as Python values: (token ids, per-request logprobs or None)."""
        token_ids = self.sampled_token_ids.tolist()
        tensors = self._logprob_tensors()
        if tensors is None:
            return token_ids, [None] * len(token_ids)
        # One .tolist() per tensor instead of per-element indexing: this runs every step.
        counts, sampled, top_ids, top_values = (t.tolist() for t in tensors)
        per_request: list[RequestLogprobs | None] = []
        for i, num_top in enumerate(counts):
            if num_top < 0:
                per_request.append(None)
                continue
            per_request.append(RequestLogprobs(sampled[i], top_ids[i][:num_top], top_values[i][:num_top]))
        return token_ids, per_request

    def _logprob_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(num_logprobs, logprobs, top ids, top logprobs), or None when no row asked."""
        if (
            self.num_logprobs is None
            or self.logprobs is None
            or self.top_logprob_token_ids is None
            or self.top_logprobs is None
        ):
            return None
        return self.num_logprobs, self.logprobs, self.top_logprob_token_ids, self.top_logprobs
