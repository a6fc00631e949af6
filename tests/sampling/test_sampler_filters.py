"""Top-k / top-p on probabilities: the candidate-window route and the full-sort route agree."""

import itertools

import pytest
import torch

from asyncpp.sampling.filters import _top_k_top_p_from_candidates, apply_min_p, apply_top_k_top_p

VOCAB_SIZE = 500
TOP_KS = [VOCAB_SIZE, 1, 5, 40, 300]  # VOCAB_SIZE = off
TOP_PS = [1.0, 0.5, 0.9, 0.99]
COMBOS = [(k, p) for k, p in itertools.product(TOP_KS, TOP_PS) if (k, p) != (VOCAB_SIZE, 1.0)]


def _zipf_probs(num_rows: int, seed: int) -> torch.Tensor:
    """Rows from flat to sharply peaked, token order shuffled: [num_rows, VOCAB_SIZE]."""
    g = torch.Generator().manual_seed(seed)
    sharpness = torch.linspace(0.2, 3.0, num_rows).unsqueeze(1)
    base = -torch.arange(1, VOCAB_SIZE + 1).float().log() * sharpness
    shuffled = base.gather(1, torch.rand(num_rows, VOCAB_SIZE, generator=g).argsort(dim=-1))
    return (shuffled + 0.01 * torch.randn(num_rows, VOCAB_SIZE, generator=g)).softmax(dim=-1)


def _batch(num_rows_per_combo: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    combos = COMBOS * num_rows_per_combo
    probs = _zipf_probs(len(combos), seed=0)
    top_k = torch.tensor([k for k, _ in combos])
    top_p = torch.tensor([p for _, p in combos])
    return probs, top_k, top_p


@pytest.mark.parametrize("num_candidates", [8, 64, VOCAB_SIZE])
def test_candidate_window_matches_full_sort(num_candidates: int) -> None:
    probs, top_k, top_p = _batch()
    by_sort = apply_top_k_top_p(probs.clone(), top_k, top_p, num_candidates=0).eq(0)
    windowed = apply_top_k_top_p(probs.clone(), top_k, top_p, num_candidates=num_candidates).eq(0)
    assert torch.equal(windowed, by_sort)
    assert not bool(by_sort.gather(1, probs.argmax(dim=-1, keepdim=True)).any())  # top token kept
    assert bool(by_sort.any())


def test_both_routes_are_exercised() -> None:
    probs, top_k, top_p = _batch()
    is_decided = _top_k_top_p_from_candidates(probs.clone(), top_k, top_p, num_candidates=64)
    assert bool(is_decided.any()) and not bool(is_decided.all())


def test_top_p_alone_matches_full_sort() -> None:
    probs = _zipf_probs(40, seed=1)
    top_p = torch.linspace(0.05, 0.99, 40)
    by_sort = apply_top_k_top_p(probs.clone(), None, top_p, num_candidates=0).eq(0)
    windowed = apply_top_k_top_p(probs.clone(), None, top_p, num_candidates=32).eq(0)
    assert torch.equal(windowed, by_sort)


def test_top_k_alone_keeps_exactly_k() -> None:
    probs = _zipf_probs(5, seed=2)
    top_k = torch.tensor([1, 2, 7, 100, VOCAB_SIZE])
    kept = (~apply_top_k_top_p(probs.clone(), top_k, None).eq(0)).sum(dim=-1)
    assert kept.tolist() == top_k.tolist()
    by_sort = apply_top_k_top_p(probs.clone(), top_k, torch.ones(5), num_candidates=0).eq(0)
    assert torch.equal((~by_sort).sum(dim=-1), kept)


def test_top_p_keeps_the_smallest_set_reaching_top_p() -> None:
    probs = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.20]])
    for top_p, expected_kept in [(0.3, {1}), (0.6, {1, 3}), (0.66, {1, 3, 4}), (1.0, set(range(5)))]:
        for num_candidates in (0, 2, 5):
            kept = ~apply_top_k_top_p(probs.clone(), None, torch.tensor([top_p]), num_candidates).eq(0)
            assert set(kept[0].nonzero().flatten().tolist()) == expected_kept, (top_p, num_candidates)


def test_top_k_with_top_p_one_keeps_all_k_even_when_the_head_has_all_the_mass() -> None:
    # In float32 the top token's prob rounds to exactly 1: the cumulative sum cannot
    # tell the other k - 1 tokens apart from the ones top-k removed.
    logits = 0.01 * torch.randn(2, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    logits[:, 0] = 30.0
    probs = logits.softmax(dim=-1)
    top_k = torch.tensor([300, VOCAB_SIZE])
    top_p = torch.tensor([1.0, 0.5])
    for num_candidates in (0, VOCAB_SIZE):
        kept = (~apply_top_k_top_p(probs.clone(), top_k, top_p, num_candidates).eq(0)).sum(dim=-1)
        assert kept.tolist() == [300, 1], num_candidates


def test_ties_at_the_kth_value_are_all_kept() -> None:
    # bf16 logits tie often; a tie that runs past the candidate window must not be cut.
    probs = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0, 0.0, 0.0, 0.0]]).softmax(dim=-1)
    for num_candidates in (0, 4, 10):
        kept = ~apply_top_k_top_p(probs.clone(), torch.tensor([3]), torch.tensor([0.999]), num_candidates).eq(0)
        assert kept[0].tolist() == [True] * 7 + [False] * 3, num_candidates


def test_rows_need_not_be_normalised() -> None:
    probs, top_k, top_p = _batch(num_rows_per_combo=2)
    scale = torch.logspace(-3, 3, probs.shape[0]).unsqueeze(1)  # a different scale per row
    for num_candidates in (0, 64):
        normalised = apply_top_k_top_p(probs.clone(), top_k, top_p, num_candidates).eq(0)
        scaled = apply_top_k_top_p(probs * scale, top_k, top_p, num_candidates).eq(0)
        assert torch.equal(scaled, normalised)


def test_min_p_is_relative_to_the_top_token() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.2, 0.2, 0.2, 0.2, 0.2]])
    kept = ~apply_min_p(probs * 7.0, torch.tensor([0.15, 0.9])).eq(0)
    assert kept.tolist() == [[True, True, True, False, False], [True] * 5]
