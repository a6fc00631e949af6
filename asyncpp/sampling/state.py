"""`RequestSamplingState`: what the sampler needs to know about one live request.

The runner on the last pipeline stage keeps one per request (keyed by request
id), appends every sampled token to `output_token_ids`, and passes the states
of a step's sampled requests to `Sampler` in row order.

Seeded requests are reproducible by construction: before each random draw the
request's own `generator` is re-seeded from `(params.seed, len(output_token_ids))`,
so the token sampled at step `n` depends only on the seed, `n` and the logits --
not on the batch, the row index, the global RNG, or whether the request was
preempted and rebuilt with `create(..., output_token_ids=<tokens so far>)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncpp.sampling.params import SamplingParams

_MASK_64 = (1 << 64) - 1


@dataclass
class RequestSamplingState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the runner appends each sampled token
    generator: torch.Generator | None  # on the sampler's device; None when unseeded

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        device: str | torch.device = "cpu",
    ) -> RequestSamplingState:
        """Build the state; copies the token lists so the state owns them."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
        return cls(params, list(prompt_token_ids), list(output_token_ids), generator)

    def step_seed(self) -> int:
        """The seed for this step's draw: a mix of `params.seed` and the step count."""
        assert self.params.seed is not None
        return _splitmix64(_splitmix64(self.params.seed) ^ len(self.output_token_ids)) >> 1


def _splitmix64(x: int) -> int:
    # A bijective 64-bit mixer: nearby (seed, step) pairs get unrelated seeds,
    # so seed s at step n+1 does not replay seed s+1 at step n.
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)
