"""The lists a request carries are bounded by their lengths alone, in the engine and in the front end."""

from __future__ import annotations

import pytest

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import MAX_STOP_STRINGS, SamplingParams, check_list_lengths


def test_stop_strings_and_stop_token_ids_are_bounded_by_their_number():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=[1] * 320).validate(320)
    with pytest.raises(InvalidRequestError, match=f"stop must hold at most {MAX_STOP_STRINGS} strings, got {MAX_STOP_STRINGS + 1}") as info:
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)).validate(320)
    assert info.value.field == "stop"
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids must hold at most 320 entries \(the vocabulary's size\), got 321") as info:
        SamplingParams(stop_token_ids=[1] * 321).validate(320)
    assert info.value.field == "stop_token_ids"
    SamplingParams(stop_token_ids=[1] * 321).validate()  # no vocabulary known: no bound by it
    check_list_lengths(MAX_STOP_STRINGS, 320, 320)
    with pytest.raises(InvalidRequestError):
        check_list_lengths(0, 321, 320)
