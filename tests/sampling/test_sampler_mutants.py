"""Edges the other sampling tests left open (found by mutation testing): top-p exactly reached by the
top tokens, on both filter routes; the seeded step mixer is SplitMix64, so a seed's tokens do not
change between releases; `stop` given as a string or a list becomes a tuple, anything else is a
client error naming the field."""

import pytest
import torch

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.filters import apply_top_k_top_p
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.state import _splitmix64


def test_top_p_reached_exactly_keeps_no_more_tokens_on_either_route() -> None:
    # Binary fractions: the top two tokens' share is exactly top_p, so the third is not needed.
    probs = torch.tensor([[0.125, 0.5, 0.375], [0.25, 0.25, 0.5]])
    top_p = torch.tensor([0.875, 0.5])
    for num_candidates in (0, 1, 3):  # 0: every row by full sort; 1: the first row by full sort
        kept = ~apply_top_k_top_p(probs.clone(), None, top_p, num_candidates).eq(0)
        assert kept.tolist() == [[False, True, True], [False, False, True]], num_candidates


def test_step_mixer_is_splitmix64() -> None:
    # Published SplitMix64 outputs (Vigna's reference generator): state 1234567, its first two outputs;
    # state 0, its first.
    assert _splitmix64(1234567) == 6457827717110365317
    assert _splitmix64((1234567 + 0x9E3779B97F4A7C15) % 2**64) == 3203168211198807973
    assert _splitmix64(0) == 0xE220A8397B1DCDAF


def test_stop_as_a_string_or_a_list_becomes_a_tuple() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize("field,value", [("stop", 5), ("stop", {"a"}), ("stop_token_ids", 3)])
def test_stop_of_another_type_is_a_client_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and f"got {type(value).__name__}" in str(info.value)
