"""`SamplingParams.validate` at every bound: the edge value is accepted, the next one is a client error
naming its field and saying why (found by mutation testing: the engine-level bad-input tests check a
few fields, not the edges)."""

import pytest

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams

VOCAB_SIZE = 100

ACCEPTED = [
    {"max_tokens": 1},
    {"temperature": 0.0},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_p": 1.0},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"repetition_penalty": 1e-6},
    {"repetition_penalty": 1e6},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"stop": ["x"], "stop_token_ids": [0, VOCAB_SIZE - 1]},
    {"logprobs": 0},
    {"logprobs": 20},
]

REJECTED = [
    ({"max_tokens": 0}, "max_tokens", "must be >= 1"),
    ({"max_tokens": True}, "max_tokens", "must be an integer, got bool"),
    ({"temperature": -0.01}, "temperature", "must be >= 0"),
    ({"top_k": -2}, "top_k", "must be -1, 0"),
    ({"top_p": 0.0}, "top_p", "must be in (0, 1]"),
    ({"top_p": 1.01}, "top_p", "must be in (0, 1]"),
    ({"min_p": -0.01}, "min_p", "must be in [0, 1]"),
    ({"min_p": 1.01}, "min_p", "must be in [0, 1]"),
    ({"min_p": "0.1"}, "min_p", "must be a finite number"),
    ({"seed": -1}, "seed", "must be in [0, 2**63)"),
    ({"seed": 2**63}, "seed", "must be in [0, 2**63)"),
    ({"seed": 1.0}, "seed", "must be an integer"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "must be in [1e-06, 1e+06]"),
    ({"repetition_penalty": 1.1e6}, "repetition_penalty", "must be in [1e-06, 1e+06]"),
    ({"presence_penalty": 2.01}, "presence_penalty", "must be in [-2, 2]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "must be in [-2, 2]"),
    ({"stop": ["x", ""]}, "stop", "non-empty strings"),
    ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids", "must be an integer"),
    ({"ignore_eos": 1}, "ignore_eos", "must be a bool, got int"),
    ({"logprobs": 21}, "logprobs", "must be in [0, 20]"),
]


@pytest.mark.parametrize("params", ACCEPTED, ids=str)
def test_edge_values_are_accepted(params: dict) -> None:
    SamplingParams(**params).validate(VOCAB_SIZE)


@pytest.mark.parametrize("params,field,why", REJECTED, ids=str)
def test_values_past_an_edge_are_a_client_error_naming_the_field(params: dict, field: str, why: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**params).validate(VOCAB_SIZE)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"{field} ") and why in message


def test_stop_token_ids_are_not_range_checked_without_a_vocabulary() -> None:
    SamplingParams(stop_token_ids=[10**6]).validate()
