"""Chi-square helpers for the sampling tests (no scipy here): the statistic and its p-value."""

from __future__ import annotations

import torch


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit of `counts` to `expected_probs` (same shape)."""
    expected = expected_probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def p_value(statistic: float, df: int) -> float:
    """The survival function of chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))
