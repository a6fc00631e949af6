"""Chi-square goodness of fit: sampled frequencies follow the filtered softmax.

The RNG is seeded, so each test is deterministic; a correct sampler fails the
p = 0.001 threshold only for an unlucky fixed seed, a wrong one fails by miles.
"""

import pytest
import torch

from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import RequestSamplingState, Sampler
from tests.chi_square import chi_square as _chi_square
from tests.chi_square import p_value as _p_value

PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])  # [vocab_size]
LOGITS = PROBS.log() + 1.5  # logits are only defined up to a shift
VOCAB_SIZE = PROBS.numel()
NUM_DRAWS = 20_000
CHI2_CRITICAL_DF7_P001 = 24.32


def _draw_counts(params: list[SamplingParams], num_draws: int = NUM_DRAWS) -> torch.Tensor:
    """Sample `num_draws` rows cycling through `params`; counts per param: [len(params), vocab_size]."""
    states = [RequestSamplingState.create(params[i % len(params)], [], []) for i in range(num_draws * len(params))]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = Sampler(VOCAB_SIZE)(LOGITS.expand(len(states), VOCAB_SIZE), states)
    tokens = out.sampled_token_ids.view(num_draws, len(params))
    return torch.stack([torch.bincount(tokens[:, j], minlength=VOCAB_SIZE) for j in range(len(params))])




def test_p_value_matches_the_table() -> None:
    assert _p_value(CHI2_CRITICAL_DF7_P001, 7) == pytest.approx(0.001, rel=1e-2)


def test_temperature_sampling_matches_softmax() -> None:
    counts = _draw_counts([SamplingParams(temperature=0.7)])[0]
    assert _chi_square(counts, torch.softmax(LOGITS / 0.7, dim=-1)) < CHI2_CRITICAL_DF7_P001


def test_seeded_and_unseeded_rows_in_one_batch_match_softmax() -> None:
    # Even rows have their own seeds (per-request generators), odd rows use the global RNG.
    num_draws = 5000
    params = [SamplingParams(temperature=0.7, seed=s if s % 2 == 0 else None) for s in range(2 * num_draws)]
    states = [RequestSamplingState.create(p, [], []) for p in params]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = Sampler(VOCAB_SIZE)(LOGITS.expand(len(states), VOCAB_SIZE), states).sampled_token_ids
    expected = torch.softmax(LOGITS / 0.7, dim=-1)
    for rows in (tokens[0::2], tokens[1::2]):
        assert _chi_square(torch.bincount(rows, minlength=VOCAB_SIZE), expected) < CHI2_CRITICAL_DF7_P001


# (params, tokens that survive the filters): worked out by hand from PROBS.
FILTER_CASES = [
    (SamplingParams(top_p=0.6), [0, 1, 2]),  # cumulative .30 .52 .68
    (SamplingParams(temperature=0.5, top_p=0.8), [0, 1, 2]),  # probs ~ PROBS**2: .47 .25 .13
    (SamplingParams(top_k=4), [0, 1, 2, 3]),
    (SamplingParams(min_p=0.25), [0, 1, 2, 3, 4]),  # keep prob >= .075
    (SamplingParams(top_k=5, top_p=0.7), [0, 1, 2]),  # renormalised over 5: .34 .25 .18
    (SamplingParams(top_k=4, min_p=0.25), [0, 1, 2, 3]),
    (SamplingParams(temperature=0.7, top_k=100), list(range(VOCAB_SIZE))),
]


def _check_filtered(counts: torch.Tensor, params: SamplingParams, kept: list[int]) -> None:
    is_dropped = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    is_dropped[kept] = False
    assert int(counts[is_dropped].sum()) == 0, (params, counts)
    expected = torch.softmax(LOGITS[kept] / params.temperature, dim=-1)
    p_value = _p_value(_chi_square(counts[kept], expected), df=len(kept) - 1)
    assert p_value > 0.001, (params, counts, p_value)


@pytest.mark.parametrize(("params", "kept"), FILTER_CASES)
def test_filtered_sampling_matches_renormalised_softmax(params: SamplingParams, kept: list[int]) -> None:
    _check_filtered(_draw_counts([params])[0], params, kept)


def test_filters_in_one_mixed_batch() -> None:
    # Rows without filters sit between filtered rows: only the filtered rows may be touched.
    params = [p for p, _ in FILTER_CASES] + [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)]
    kept = [k for _, k in FILTER_CASES] + [list(range(VOCAB_SIZE)), [0]]
    counts = _draw_counts(params, num_draws=10_000)
    for j, (p, k) in enumerate(zip(params[:-1], kept[:-1])):
        _check_filtered(counts[j], p, k)
    assert int(counts[-1, 0]) == 10_000  # greedy


def test_top_k_rows_with_different_k() -> None:
    # Only top-k (no top-p) in the batch: the partial-sort path, with a different k per row.
    cases = [(SamplingParams(top_k=2), [0, 1]), (SamplingParams(top_k=6), list(range(6)))]
    cases += [
        (SamplingParams(top_k=3, min_p=0.25), [0, 1, 2]),
        (SamplingParams(temperature=0.7), list(range(VOCAB_SIZE))),
    ]
    counts = _draw_counts([p for p, _ in cases], num_draws=10_000)
    for j, (p, k) in enumerate(cases):
        _check_filtered(counts[j], p, k)
