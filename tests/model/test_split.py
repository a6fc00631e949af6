"""Layer split: explicit lists are checked, the default balances the last stage's head."""

from __future__ import annotations

import pytest

from asyncpp.model.split import compute_layer_ranges, head_cost_in_layers, held_ranges, shift_windows
from asyncpp.weights import read_arch


def test_explicit_split():
    assert compute_layer_ranges(6, 3, (2, 3, 1)) == [(0, 2), (2, 5), (5, 6)]


@pytest.mark.parametrize("split,words", [((2, 2), "sum to"), ((6, 0), "positive"), ((6,), "entries")])
def test_bad_explicit_split(split, words):
    with pytest.raises(ValueError, match=words):
        compute_layer_ranges(6, 2, split)


def test_even_split_without_head_cost():
    assert compute_layer_ranges(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert compute_layer_ranges(4, 1) == [(0, 4)]
    with pytest.raises(ValueError, match="larger than"):
        compute_layer_ranges(2, 3)


def test_balanced_split_gives_the_last_stage_fewer_layers():
    assert compute_layer_ranges(30, 2, (), 4.0) == [(0, 17), (17, 30)]
    assert compute_layer_ranges(30, 3, (), 4.0) == [(0, 12), (12, 23), (23, 30)]
    assert compute_layer_ranges(2, 2, (), 100.0) == [(0, 1), (1, 2)]  # never an empty stage


def test_head_cost_of_smollm2_is_a_few_layers():
    from tests.conftest import skip_without_real_model

    skip_without_real_model()
    # 49152 x 576 head vs 3.54M parameters per layer: 8 layers of weights, counted at three quarters.
    assert head_cost_in_layers(read_arch("gguf", None)) == pytest.approx(6.0, abs=0.05)


def test_shift_windows_keep_a_layer_on_every_stage():
    ranges = [(0, 18), (18, 30)]
    assert shift_windows(ranges, 4) == [(14, 22)]
    assert held_ranges(ranges, shift_windows(ranges, 4)) == [(0, 22), (14, 30)]
    # Narrow stages: each window stops where a stage would be left with no layer of its own.
    ranges = [(0, 3), (3, 5), (5, 8)]
    windows = shift_windows(ranges, 4)
    assert windows == [(1, 4), (5, 7)]
    assert held_ranges(ranges, windows) == [(0, 4), (1, 7), (5, 8)]
    for (lo, hi), (next_lo, _) in zip(windows, windows[1:]):
        assert hi < next_lo
    # No shift: the windows are the boundaries and every stage holds its own layers.
    assert shift_windows(ranges, 0) == [(3, 3), (5, 5)]
    assert held_ranges(ranges, shift_windows(ranges, 0)) == ranges
    with pytest.raises(ValueError, match="shift_layers"):
        shift_windows(ranges, -1)
