"""`Sampler`: turns one step's logits into one token per request.

Runs on the last pipeline stage. Row i of `logits` belongs to `states[i]`.
Per step, in order:
1. logprobs (only for rows that asked): log-softmax of the raw logits, before
   penalties and temperature (vLLM's default "raw_logprobs");
2. penalties (skipped when no row uses them), see `penalties.py`;
3. greedy rows (temperature == 0): argmax of the penalized logits;
4. random rows: softmax(logits / temperature), then min-p, top-k, top-p on
   those probs (`filters.py`), then the exponential race `argmax(probs / q)`,
   q ~ Exponential(1), which samples from `probs`. A seeded row draws its q
   from its own generator, re-seeded per step (see `state.py`), so its tokens
   never depend on the batch; unseeded rows share one draw from the global RNG.
   `filtered_probs` exposes the filtered probs (the speculative rejection
   sampler verifies drafts against them).

All math is float32 whatever the logits dtype (a batch that is all plain
greedy takes argmax in the input dtype, which is exact; every argmax is
`argmax_rows`: torch's first-maximum rule, a C kernel on CPU). The input tensor is
never written to. Results come back on the CPU. Seeded states' generators
must live on the sampler's device (`RequestSamplingState.create(device=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncpp.host_copy import to_device
from asyncpp.kernels.argmax import argmax_rows
from asyncpp.sampling.filters import apply_min_p, apply_top_k_top_p
from asyncpp.sampling.output import RequestLogprobs, SamplerOutput
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.penalties import apply_penalties
from asyncpp.sampling.state import RequestSamplingState

__all__ = ["RequestLogprobs", "RequestSamplingState", "Sampler", "SamplerOutput"]


class Sampler:
    def __init__(self, vocab_size: int, device: str | torch.device = "cpu", isa: str | None = None) -> None:
        """`isa`: the level the CPU argmax kernel is built for (None: the CPU's best)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.isa = isa

    def __call__(self, logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> SamplerOutput:
        """`logits`: [num_reqs, vocab_size], any float dtype."""
        if logits.dim() != 2 or logits.shape[0] != len(states) or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits must be [num_reqs={len(states)}, vocab_size={self.vocab_size}], got {list(logits.shape)}"
            )
        if not self.reads_history(states):  # only the tokens: no logprobs, penalties or seeded draws
            return SamplerOutput(self.sample_on_device(logits, states).cpu())
        logits = logits.to(device=self.device, dtype=torch.float32)
        logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = None  # [num_logprob_rows, vocab_size]
        if logprob_rows:
            raw_logprobs = logits[self._index(logprob_rows)].log_softmax(dim=-1)

        logits = apply_penalties(logits, states)
        sampled_token_ids = self._sample(logits, states)  # [num_reqs]

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids.cpu())
        return self._with_logprobs(sampled_token_ids, raw_logprobs, logprob_rows, states)

    @staticmethod
    def reads_history(states: Sequence[RequestSamplingState]) -> bool:
        """Whether a draw for `states` needs the host to know their tokens so far (penalties, seeds)
        or returns more than the tokens (logprobs)."""
        return any(
            s.params.uses_penalties or s.params.logprobs is not None or (s.params.seed is not None and not s.params.is_greedy)
            for s in states
        )

    def sample_on_device(self, logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
        """The tokens `__call__` would return, left on the sampler's device ([num_reqs] int64). Only
        for `states` that do not `reads_history`."""
        if self.reads_history(states):
            raise ValueError("sample_on_device: a request uses penalties, a seed or logprobs")
        logits = logits.to(device=self.device)
        if all(s.params.is_greedy for s in states):
            # argmax is exact in any float dtype: skip the float32 copy.
            return argmax_rows(logits, self.isa)
        return self._sample(logits.to(dtype=torch.float32), states)

    def _sample(self, logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
        random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if not random_rows:
            return argmax_rows(logits, self.isa)
        if len(random_rows) == len(states):
            return self.sample_random(logits, states)
        greedy_rows = [i for i, s in enumerate(states) if s.params.is_greedy]
        greedy_ids = self._index(greedy_rows)
        random_ids = self._index(random_rows)
        sampled = torch.empty(len(states), dtype=torch.int64, device=self.device)
        sampled[greedy_ids] = argmax_rows(logits[greedy_ids], self.isa)
        sampled[random_ids] = self.sample_random(logits[random_ids], [states[i] for i in random_rows])
        return sampled

    def sample_random(self, logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
        """One token per row: `logits`, [n, vocab_size] float32, already penalized, rows of non-greedy
        requests (not written to); `states[j]` row j's (a seeded row draws with its step seed)."""
        probs = self.filtered_probs(logits, states)
        # The race needs no renormalisation after the filters: argmax(c * probs / q) is argmax(probs / q).
        exponentials = self._draw_exponentials(states, probs.shape)
        return argmax_rows(probs.div_(exponentials), self.isa)

    def filtered_probs(self, logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
        """What random rows sample from: softmax(logits / temperature), then min-p, top-k, top-p.

        `logits`: [n, vocab_size] float32, already penalized, rows of non-greedy
        requests; not written to. Returns a fresh [n, vocab_size] float32 tensor,
        each row proportional to its distribution but NOT renormalised after the
        filters (divide by the row sum for probabilities).
        """
        params = [s.params for s in states]
        temperatures = to_device([p.temperature for p in params], self.device, torch.float32)
        probs = (logits / temperatures.unsqueeze(1)).softmax(dim=-1)  # a fresh tensor the filters may write to

        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            apply_min_p(probs, to_device(min_p, self.device, torch.float32))
        self._apply_top_k_top_p(probs, params)
        return probs

    def _apply_top_k_top_p(self, probs: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        """Filter in place, sorting only the rows that use top-k or top-p."""
        top_k = [self._effective_top_k(p.top_k) for p in params]
        top_p = [p.top_p for p in params]
        rows = [j for j in range(len(params)) if top_k[j] < self.vocab_size or top_p[j] < 1.0]
        if not rows:
            return
        uses_top_k = any(top_k[j] < self.vocab_size for j in rows)
        uses_top_p = any(top_p[j] < 1.0 for j in rows)
        k = to_device([top_k[j] for j in rows], self.device, torch.int64) if uses_top_k else None
        p = to_device([top_p[j] for j in rows], self.device, torch.float32) if uses_top_p else None
        if len(rows) == len(params):
            apply_top_k_top_p(probs, k, p)
            return
        row_ids = self._index(rows)
        probs[row_ids] = apply_top_k_top_p(probs[row_ids], k, p)

    def _effective_top_k(self, top_k: int) -> int:
        # 0 / -1 mean off; a k past the vocabulary is a no-op, not an error.
        return self.vocab_size if top_k <= 0 else min(top_k, self.vocab_size)

    def _draw_exponentials(self, states: Sequence[RequestSamplingState], shape: torch.Size) -> torch.Tensor:
        """Exponential(1) draws as -log(u), u ~ U[0, 1): [n, vocab_size].

        Inverting uniforms costs a third of `exponential_` on CPU. u < 1, so
        q > 0 and probs / q is never 0 / 0 (NaN, which argmax would pick).
        """
        uniforms = torch.empty(shape, dtype=torch.float32, device=self.device)
        unseeded_rows = [j for j, s in enumerate(states) if s.generator is None]
        if len(unseeded_rows) == len(states):
            uniforms.uniform_()
        elif unseeded_rows:
            uniforms[self._index(unseeded_rows)] = torch.rand(
                (len(unseeded_rows), shape[1]), dtype=torch.float32, device=self.device
            )
        for j, state in enumerate(states):
            if state.generator is not None:
                state.generator.manual_seed(state.step_seed())
                uniforms[j].uniform_(generator=state.generator)
        return uniforms.log_().neg_()

    def _with_logprobs(
        self,
        sampled_token_ids: torch.Tensor,
        raw_logprobs: torch.Tensor,
        logprob_rows: list[int],
        states: Sequence[RequestSamplingState],
    ) -> SamplerOutput:
        num_reqs = len(states)
        row_ids = self._index(logprob_rows)
        requested = (s.params.logprobs for s in states)
        counts = [min(n, self.vocab_size) for n in requested if n is not None]  # in logprob_rows order
        max_num_logprobs = max(counts)

        sampled_logprobs = torch.full((num_reqs,), float("nan"), dtype=torch.float32, device=self.device)
        sampled_logprobs[row_ids] = raw_logprobs.gather(1, sampled_token_ids[row_ids].unsqueeze(1)).squeeze(1)
        top_logprobs = torch.full((num_reqs, max_num_logprobs), float("nan"), dtype=torch.float32, device=self.device)
        top_token_ids = torch.full((num_reqs, max_num_logprobs), -1, dtype=torch.int64, device=self.device)
        if max_num_logprobs > 0:
            top = raw_logprobs.topk(max_num_logprobs, dim=-1)  # sorted, most likely first
            top_logprobs[row_ids] = top.values
            top_token_ids[row_ids] = top.indices
        num_logprobs = torch.full((num_reqs,), -1, dtype=torch.int64)
        num_logprobs[logprob_rows] = torch.tensor(counts, dtype=torch.int64)
        return SamplerOutput(
            sampled_token_ids=sampled_token_ids.cpu(),
            logprobs=sampled_logprobs.cpu(),
            top_logprob_token_ids=top_token_ids.cpu(),
            top_logprobs=top_logprobs.cpu(),
            num_logprobs=num_logprobs,
        )

    def _index(self, rows: list[int]) -> torch.Tensor:
        return to_device(rows, self.device, torch.int64)
