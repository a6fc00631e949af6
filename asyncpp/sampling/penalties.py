"""Repetition, presence and frequency penalties over a batch of logits rows.

Semantics follow what vLLM users expect:
- repetition_penalty (HF): for every token seen in prompt + output, a positive
  logit is divided by the penalty and a negative one multiplied by it;
- frequency_penalty (OpenAI): subtract `count_in_output * penalty`;
- presence_penalty (OpenAI): subtract `penalty` once if the token is in the output.
Repetition is applied first, then frequency and presence.

`apply_penalties` returns a new tensor and never writes to its input; rows of
requests without penalties come back bit-identical, so a request's result does
not depend on its batch neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncpp.host_copy import to_device
from asyncpp.sampling.state import RequestSamplingState


def apply_penalties(logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
    """`logits`: [num_reqs, vocab_size] float32, row i belongs to `states[i]`."""
    rows = [i for i, state in enumerate(states) if state.params.uses_penalties]
    if not rows:
        return logits
    device = logits.device
    num_rows, vocab_size = len(rows), logits.shape[1]
    penalized = [states[i] for i in rows]
    row_ids = to_device(rows, device, torch.int64)  # [num_rows]
    # Only the seen tokens change, so work is gather/scatter over padded id
    # tensors; a spare last column absorbs the padding id `vocab_size`.
    row_logits = torch.empty(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    row_logits[:, :vocab_size] = logits.index_select(0, row_ids)
    row_logits[:, vocab_size] = 0.0
    output_ids = _padded([s.output_token_ids for s in penalized], vocab_size, device)  # [num_rows, max_output]

    repetition = [s.params.repetition_penalty for s in penalized]
    if any(r != 1.0 for r in repetition):
        seen_ids = torch.cat(
            [_padded([s.prompt_token_ids for s in penalized], vocab_size, device), output_ids], dim=1
        )  # [num_rows, max_prompt + max_output]; repeats are harmless, each writes the same value
        seen = row_logits.gather(1, seen_ids)
        penalty = _column(repetition, device)
        row_logits.scatter_(1, seen_ids, torch.where(seen > 0, seen / penalty, seen * penalty))

    if output_ids.shape[1] > 0:
        output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
        output_counts.scatter_add_(1, output_ids, torch.ones(output_ids.shape, dtype=torch.float32, device=device))
        counts = output_counts.gather(1, output_ids)  # [num_rows, max_output], count of each position's token
        frequency = _column([s.params.frequency_penalty for s in penalized], device)
        presence = _column([s.params.presence_penalty for s in penalized], device)
        penalized_output = row_logits.gather(1, output_ids) - frequency * counts - presence
        row_logits.scatter_(1, output_ids, penalized_output)
    return logits.index_copy(0, row_ids, row_logits[:, :vocab_size])


def _padded(token_id_lists: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """[num_lists, max_len] int64, short lists right-padded with `pad_id`."""
    max_len = max((len(ids) for ids in token_id_lists), default=0)
    return torch.tensor(
        [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_id_lists], dtype=torch.int64, device=device
    ).view(len(token_id_lists), max_len)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, device, torch.float32).unsqueeze(1)  # [n, 1]
