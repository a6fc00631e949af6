"""Truncation filters on probabilities: min-p, top-k, top-p.

The filters take `probs`: [n, vocab_size] float32, non-negative and
proportional to each row's distribution (rows need not sum to 1: the sampler's
exponential race does not care, and skipping the renormalisation saves a pass).
Each filter zeroes the tokens it removes, in place, and returns the same
tensor. Every filter keeps at least the most likely token of each row.

- min-p: keep tokens with prob >= min_p * (max prob of the row);
- top-k: keep the k most likely tokens (ties at the k-th value are all kept);
- top-p: keep the smallest set of most likely tokens whose share of the row's
  mass is >= top_p, measured after top-k (vLLM's order). Which of several
  tokens tied at the boundary is kept is unspecified.

Top-p first looks only at each row's `num_candidates` best tokens (a partial
sort, far cheaper than sorting the vocabulary); rows those candidates cannot
decide -- a flat distribution, or a top-k larger than the window -- fall back
to one full sort of just those rows. Both routes give the same result.
"""

from __future__ import annotations

import torch

# Real LM distributions put top_p = 0.9-0.95 of their mass in a few dozen
# tokens, so this window decides almost every row without a full sort.
DEFAULT_NUM_CANDIDATES = 256


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`min_p`: [n] float32, 0 = off."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [n, 1]
    return probs.masked_fill_(probs < threshold, 0.0)


def apply_top_k_top_p(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    num_candidates: int = DEFAULT_NUM_CANDIDATES,
) -> torch.Tensor:
    """`top_k`: [n] int64 in [1, vocab_size] (vocab_size = off), or None if no row uses it.

    `top_p`: [n] float32 in (0, 1] (1 = off), or None if no row uses it.
    """
    if top_p is None:
        if top_k is not None:
            # top-k alone needs only the k-th largest value per row.
            kth_largest = probs.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
            probs.masked_fill_(probs < kth_largest, 0.0)
        return probs
    is_decided = _top_k_top_p_from_candidates(probs, top_k, top_p, num_candidates)  # [n]
    if not bool(is_decided.all()):
        undecided = (~is_decided).nonzero().squeeze(1)
        probs[undecided] = _top_k_top_p_by_sort(
            probs[undecided], None if top_k is None else top_k[undecided], top_p[undecided]
        )
    return probs


def _top_k_top_p_from_candidates(
    probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, num_candidates: int
) -> torch.Tensor:
    """Filter the rows the best `num_candidates` tokens decide; return which rows those were."""
    num_reqs, vocab_size = probs.shape
    num_candidates = min(num_candidates, vocab_size)
    if num_candidates == 0:
        return torch.zeros(num_reqs, dtype=torch.bool, device=probs.device)
    candidate_probs, candidate_ids = probs.topk(num_candidates, dim=-1)  # [n, num_candidates], best first

    is_decided = torch.ones(num_reqs, dtype=torch.bool, device=probs.device)
    if top_k is None:
        uses_top_k = torch.zeros(num_reqs, dtype=torch.bool, device=probs.device)
    else:
        uses_top_k = top_k < vocab_size
        kth_largest = candidate_probs.gather(1, (top_k.clamp_max(num_candidates) - 1).unsqueeze(1))  # [n, 1]
        # The window holds the whole top-k set only if it ends below the k-th value (ties included).
        holds_top_k = (top_k <= num_candidates) & (
            (candidate_probs[:, -1] < kth_largest.squeeze(1)) | (num_candidates == vocab_size)
        )
        is_decided &= ~uses_top_k | holds_top_k
        is_cut = uses_top_k.unsqueeze(1) & (candidate_probs < kth_largest)
        candidate_probs = candidate_probs.masked_fill(is_cut, 0.0)

    # The mass top-p measures against: the whole row, or the top-k set after top-k.
    total_mass = candidate_probs.sum(dim=-1)  # [n]
    if not bool(uses_top_k.all()):
        total_mass = torch.where(uses_top_k, total_mass, probs.sum(dim=-1))
    cumulative_mass = candidate_probs.cumsum(dim=-1)
    # Keep a token while the share of the tokens ranked above it is still < top_p;
    # top_p == 1 keeps everything even where float error lets the sum reach 1 early.
    threshold = (top_p * total_mass).unsqueeze(1)  # [n, 1]
    is_kept = ((cumulative_mass - candidate_probs) < threshold) | (top_p >= 1.0).unsqueeze(1)
    is_kept &= candidate_probs > 0.0
    is_kept[:, 0] = True
    # A row without top-k is decided once the window's mass reaches top_p;
    # one whose top-k set fits in the window always is (that set is all its mass).
    is_decided &= uses_top_k | (cumulative_mass[:, -1] >= threshold.squeeze(1))

    is_dropped = torch.ones_like(probs, dtype=torch.bool).scatter_(1, candidate_ids, ~is_kept)
    if not bool(is_decided.all()):
        is_dropped &= is_decided.unsqueeze(1)  # undecided rows are left for the full sort
    probs.masked_fill_(is_dropped, 0.0)
    return is_decided


def _top_k_top_p_by_sort(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """The exact fallback: one ascending sort, masks built in sorted order and scattered back."""
    sorted_probs, sorted_token_ids = probs.sort(dim=-1)  # [n, vocab_size] each
    vocab_size = probs.shape[1]
    if top_k is not None:
        kth_largest = sorted_probs.gather(1, (vocab_size - top_k).unsqueeze(1))  # [n, 1]
        sorted_probs.masked_fill_(sorted_probs < kth_largest, 0.0)
    # Drop the least likely tokens while the share dropped so far stays <= 1 - top_p:
    # what remains is then the smallest top set with share >= top_p.
    cumulative_mass = sorted_probs.cumsum(dim=-1)
    is_dropped = cumulative_mass <= ((1.0 - top_p) * cumulative_mass[:, -1]).unsqueeze(1)
    is_dropped[:, -1] = False  # float error must never drop the most likely token
    sorted_probs.masked_fill_(is_dropped, 0.0)
    return probs.scatter_(1, sorted_token_ids, sorted_probs)
