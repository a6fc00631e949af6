"""`Request` helpers the scheduler leans on every step."""

from __future__ import annotations

import itertools

from asyncpp.core.request import Request, RequestStatus
from asyncpp.sampling.params import SamplingParams


def test_token_ids_between_is_a_slice_of_all_token_ids():
    request = Request("r", [1, 2, 3, 4], SamplingParams(), output_token_ids=[5, 6, 7])
    n = request.num_tokens
    for start, end in itertools.combinations_with_replacement(range(n + 2), 2):
        assert request.token_ids_between(start, end) == request.all_token_ids[start:end], (start, end)
    assert Request("e", [1], SamplingParams()).token_ids_between(0, 1) == [1]


def test_only_finished_statuses_are_finished():
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
    }
    assert [s.finish_reason for s in RequestStatus] == [None, None, None, None, "stop", "length", "abort", "error"]


def test_all_token_ids_follows_the_outputs_between_calls():
    request = Request("r", [1, 2, 3], SamplingParams(), output_token_ids=[4])
    assert request.all_token_ids == [1, 2, 3, 4]
    kept = request.all_token_ids
    for token_id in (5, 6):
        request.output_token_ids.append(token_id)
        assert request.all_token_ids == [1, 2, 3, 4, 5, 6][: request.num_tokens]
    request.output_token_ids.extend([7, 8])
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and request.all_token_ids is kept  # extended, not rebuilt
    request.output_token_ids = [9]  # replaced whole (a test setting a request up): rebuilt
    assert request.all_token_ids == [1, 2, 3, 9]
    assert request.prompt_token_ids == [1, 2, 3]  # the prompt list itself is never extended
