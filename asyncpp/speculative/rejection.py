"""`RejectionSampler`: verifies draft tokens against the target model's logits.

Runs on the last pipeline stage. A request with d >= 0 drafts [d_1..d_d] owns
1 + d consecutive logits rows; row j is the target's distribution for the
token after "tokens so far + d_1..d_j", and is processed as if those drafts had
already been sampled: penalties see them, and a seeded request's draw uses the
step seed of output length len(output) + j.

- greedy (temperature 0): t_j = argmax of row j (`argmax_rows`, as `Sampler`);
  d_{j+1} is accepted while t_j == d_{j+1}. The output t_0..t_m equals
  one-token-at-a-time greedy decoding exactly.
- random: t_j = the token `Sampler` draws from row j (p_j, built exactly as
  `Sampler.filtered_probs` does; the exponential race, a seeded request's
  from its generator re-seeded with row j's step seed); d_{j+1} is accepted
  while t_j == d_{j+1}, and the output is t_0..t_m. A one-hot draft is thus
  accepted with probability p_j(d_{j+1}), as rejection sampling accepts it,
  and a rejection's token follows p_j without the draft, renormalised: the
  same distribution. But each output token is exactly the one plain sampling
  draws at that position, so a seeded request's tokens depend only on the
  seed, the positions and the logits: never on the batch, nor on which drafts
  were verified where (drafts differ with timing under async scheduling, and
  after a preemption or a stage restart).

A batch without any drafts is handed to `Sampler` itself, so speculation
changes nothing for it. Output token i's logprobs come from row i: the raw
log-softmax (before penalties and temperature) and the row's top-N.
`states` are not modified (their generators are re-seeded, as `Sampler` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncpp.kernels.argmax import argmax_rows
from asyncpp.sampling.output import SamplerOutput
from asyncpp.sampling.penalties import apply_penalties
from asyncpp.sampling.sampler import Sampler
from asyncpp.sampling.state import RequestSamplingState
from asyncpp.worker.outputs import Logprobs

__all__ = ["RejectionSampler", "VerifiedTokens"]


@dataclass(frozen=True)
class VerifiedTokens:
    token_ids: list[list[int]]  # per request: the accepted drafts, then one more token (len 1..d+1)
    logprobs: list[list[Logprobs] | None]  # per request, one per token in token_ids; None where not asked
    num_draft_tokens: list[int]  # per request: d
    num_accepted: list[int]  # per request: drafts accepted (len(token_ids) - 1)


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        states: Sequence[RequestSamplingState],
        draft_token_ids: Sequence[Sequence[int]],
    ) -> VerifiedTokens:
        """`logits`: [sum(1 + len(drafts_i)), vocab_size], each request's rows consecutive, in request order."""
        self._validate(logits, states, draft_token_ids)
        num_draft_tokens = [len(drafts) for drafts in draft_token_ids]
        if not any(num_draft_tokens):
            return _from_sampler_output(self.sampler(logits, states))

        starts = [0]  # first row of each request, then the total
        for d in num_draft_tokens:
            starts.append(starts[-1] + 1 + d)
        row_states = _row_states(states, draft_token_ids)  # [num_rows]
        logits = logits.to(device=self.sampler.device)
        is_plain_greedy = all(
            s.params.is_greedy and s.params.logprobs is None and not s.params.uses_penalties for s in states
        )
        if not is_plain_greedy:  # argmax alone is exact in any dtype, as in `Sampler`
            logits = logits.to(dtype=torch.float32)
        penalized = apply_penalties(logits, row_states)  # a new tensor where any row has penalties

        token_ids: list[list[int]] = [[] for _ in states]
        greedy_reqs = [i for i, s in enumerate(states) if s.params.is_greedy]
        random_reqs = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if greedy_reqs:
            self._verify_greedy(penalized, greedy_reqs, starts, draft_token_ids, token_ids)
        if random_reqs:
            self._verify_random(penalized, random_reqs, starts, row_states, draft_token_ids, token_ids)
        return VerifiedTokens(
            token_ids=token_ids,
            logprobs=self._logprobs(logits, states, starts, token_ids),
            num_draft_tokens=num_draft_tokens,
            num_accepted=[len(tokens) - 1 for tokens in token_ids],
        )

    def _validate(
        self, logits: torch.Tensor, states: Sequence[RequestSamplingState], draft_token_ids: Sequence[Sequence[int]]
    ) -> None:
        if len(draft_token_ids) != len(states):
            raise ValueError(f"got {len(draft_token_ids)} draft lists for {len(states)} requests")
        num_rows = sum(1 + len(drafts) for drafts in draft_token_ids)
        vocab_size = self.sampler.vocab_size
        if logits.dim() != 2 or logits.shape[0] != num_rows or logits.shape[1] != vocab_size:
            raise ValueError(
                f"logits must be [num_rows={num_rows} (1 + drafts per request, {len(states)} requests), "
                f"vocab_size={vocab_size}], got {list(logits.shape)}"
            )
        for drafts in draft_token_ids:
            for t in drafts:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"draft token {t} is outside the vocabulary [0, {vocab_size})")

    def _verify_greedy(
        self,
        penalized: torch.Tensor,
        reqs: list[int],
        starts: list[int],
        draft_token_ids: Sequence[Sequence[int]],
        token_ids: list[list[int]],
    ) -> None:
        rows = [r for i in reqs for r in range(starts[i], starts[i + 1])]
        argmax = argmax_rows(penalized[self._index(rows)], self.sampler.isa).tolist()  # [len(rows)]
        _accept(argmax, reqs, draft_token_ids, token_ids)

    def _verify_random(
        self,
        penalized: torch.Tensor,
        reqs: list[int],
        starts: list[int],
        row_states: list[RequestSamplingState],
        draft_token_ids: Sequence[Sequence[int]],
        token_ids: list[list[int]],
    ) -> None:
        rows = [r for i in reqs for r in range(starts[i], starts[i + 1])]  # of all random requests, in order
        random_logits = penalized if len(rows) == penalized.shape[0] else penalized[self._index(rows)]
        # Every row's token as `Sampler` draws it at that position (a seeded row from its generator
        # re-seeded with the row's step seed).
        drawn = self.sampler.sample_random(random_logits, [row_states[r] for r in rows]).tolist()
        _accept(drawn, reqs, draft_token_ids, token_ids)

    def _logprobs(
        self,
        logits: torch.Tensor,
        states: Sequence[RequestSamplingState],
        starts: list[int],
        token_ids: list[list[int]],
    ) -> list[list[Logprobs] | None]:
        """Token i of a request's output: the raw log-softmax of its row i at that token, and the row's top-N."""
        reqs = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not reqs:
            return [None] * len(states)
        rows = [starts[i] + j for i in reqs for j in range(len(token_ids[i]))]
        raw_logprobs = logits[self._index(rows)].log_softmax(dim=-1)  # [len(rows), vocab], float32
        tokens = self._index([t for i in reqs for t in token_ids[i]])
        token_logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        counts = {i: min(states[i].params.logprobs, self.sampler.vocab_size) for i in reqs}
        max_count = max(counts.values())
        top_ids: list[list[int]] = [[] for _ in rows]
        top_values: list[list[float]] = [[] for _ in rows]
        if max_count > 0:
            top = raw_logprobs.topk(max_count, dim=-1)  # sorted, most likely first
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        result: list[list[Logprobs] | None] = [None] * len(states)
        offset = 0
        for i in reqs:
            n = counts[i]
            result[i] = [
                Logprobs(token_logprobs[k], top_ids[k][:n], top_values[k][:n])
                for k in range(offset, offset + len(token_ids[i]))
            ]
            offset += len(token_ids[i])
        return result

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.sampler.device)


def _accept(
    drawn: list[int], reqs: list[int], draft_token_ids: Sequence[Sequence[int]], token_ids: list[list[int]]
) -> None:
    """`drawn`: the token drawn from each row of `reqs`, request after request (1 + its drafts rows).
    Each request's output: its drafts while they equal the token drawn before them, then one more
    drawn token (the first that differs from its draft, or the bonus row's)."""
    offset = 0
    for i in reqs:
        drafts = draft_token_ids[i]
        mine = drawn[offset : offset + 1 + len(drafts)]
        offset += len(mine)
        num_accepted = 0
        while num_accepted < len(drafts) and mine[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        token_ids[i] = mine[: num_accepted + 1]


def _row_states(
    states: Sequence[RequestSamplingState], draft_token_ids: Sequence[Sequence[int]]
) -> list[RequestSamplingState]:
    """One state per logits row: row j of a request sees its drafts d_1..d_j as already sampled.

    Shallow copies (the generator is shared: it is re-seeded before every
    draw); only rows whose penalties or step seed depend on the output get one.
    """
    row_states = []
    for state, drafts in zip(states, draft_token_ids):
        row_states.append(state)
        needs_copy = state.params.uses_penalties or state.generator is not None
        for j in range(1, len(drafts) + 1):
            if needs_copy:
                output_token_ids = state.output_token_ids + list(drafts[:j])
                row_states.append(dataclasses.replace(state, output_token_ids=output_token_ids))
            else:
                row_states.append(state)
    return row_states


def _from_sampler_output(out: SamplerOutput) -> VerifiedTokens:
    token_ids, request_logprobs = out.to_lists()
    return VerifiedTokens(
        token_ids=[[t] for t in token_ids],
        logprobs=[
            None if lp is None else [Logprobs(lp.sampled_logprob, lp.top_token_ids, lp.top_logprobs)]
            for lp in request_logprobs
        ],
        num_draft_tokens=[0] * len(token_ids),
        num_accepted=[0] * len(token_ids),
    )
