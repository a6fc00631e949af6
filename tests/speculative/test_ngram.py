"""NgramProposer: exact drafts on hand-written sequences, and random start/extend sequences against a brute-force scan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpp.speculative.ngram import NgramProposer


def reference_drafts(token_ids: list[int], min_n: int, max_n: int, max_num_tokens: int) -> list[int]:
    """Prompt lookup by scanning: longest n first, then the most recent earlier occurrence of the suffix."""
    if max_num_tokens <= 0:
        return []
    num_tokens = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        suffix = token_ids[num_tokens - n :] if n <= num_tokens else None
        if suffix is None:
            continue
        for start in range(num_tokens - n - 1, -1, -1):  # the suffix itself starts at num_tokens - n: excluded
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + max_num_tokens]
    return []


def drafts(token_ids: list[int], max_num_tokens: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    proposer = NgramProposer(min_n, max_n)
    proposer.start("r", token_ids)
    return proposer.propose("r", max_num_tokens)


# ---- exact drafts ------------------------------------------------------------------------------


def test_the_longest_suffix_wins():
    # (1, 2, 3) was followed by 9, 7; the more recent (2, 3) by 8, 1.
    token_ids = [1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3]
    assert drafts(token_ids, 2, min_n=2, max_n=3) == [9, 7]


def test_max_n_caps_the_suffix_length():
    token_ids = [1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3]
    assert drafts(token_ids, 2, min_n=2, max_n=2) == [8, 1]


def test_the_most_recent_occurrence_wins():
    assert drafts([5, 6, 1, 5, 6, 2, 5, 6], 2, min_n=2, max_n=2) == [2, 5]


def test_the_suffix_itself_is_not_an_occurrence():
    # Were the suffix (1, 2) indexed as its own latest occurrence, its continuation would be empty.
    assert drafts([1, 2, 9, 1, 2], 3, min_n=2, max_n=2) == [9, 1, 2]


def test_an_overlapping_earlier_occurrence_counts():
    assert drafts([1, 1, 1], 4, min_n=2, max_n=2) == [1]


def test_a_continuation_that_reaches_the_end_is_truncated():
    assert drafts([1, 2, 3, 1, 2], 5, min_n=2, max_n=2) == [3, 1, 2]


def test_max_num_tokens_caps_the_drafts():
    assert drafts([1, 2, 3, 4, 5, 1, 2], 2) == [3, 4]
    assert drafts([1, 2, 3, 4, 5, 1, 2], 1) == [3]


@pytest.mark.parametrize("max_num_tokens", [0, -1])
def test_no_drafts_asked_gives_none(max_num_tokens):
    assert drafts([1, 2, 3, 1, 2], max_num_tokens) == []


def test_no_earlier_occurrence_gives_no_drafts():
    assert drafts([4, 5, 6, 7, 8], 4) == []
    assert drafts([], 4) == []
    assert drafts([3], 4, min_n=1, max_n=1) == []


def test_min_n_is_respected():
    # Only the 1-gram (1,) recurs.
    assert drafts([7, 1, 8, 1], 2, min_n=2, max_n=3) == []
    assert drafts([7, 1, 8, 1], 2, min_n=1, max_n=3) == [8, 1]


def test_extend_makes_the_old_suffix_an_earlier_occurrence():
    proposer = NgramProposer(2, 2)
    proposer.start("r", [4, 5])
    assert proposer.propose("r", 3) == []
    proposer.extend("r", [6, 4])
    assert proposer.propose("r", 3) == []
    proposer.extend("r", [5])
    assert proposer.propose("r", 3) == [6, 4, 5]


def test_propose_leaves_the_state_unchanged():
    proposer = NgramProposer(2, 2)
    proposer.start("r", [1, 2, 3, 1, 2])
    assert proposer.propose("r", 2) == [3, 1]
    assert proposer.propose("r", 2) == [3, 1]
    proposer.extend("r", [7])  # the draft was rejected: 7 follows, not 3
    assert proposer.propose("r", 2) == []


def test_the_callers_lists_are_copied_not_kept():
    proposer = NgramProposer(2, 2)
    prompt = [1, 2, 3, 1, 2]
    proposer.start("r", prompt)
    prompt.append(9)
    proposer.extend("r", [3])
    assert prompt == [1, 2, 3, 1, 2, 9]
    assert proposer.propose("r", 2) == [1, 2]


def test_start_again_replaces_the_state():
    proposer = NgramProposer(2, 2)
    proposer.start("r", [1, 2, 9, 1, 2])
    assert proposer.propose("r", 2) == [9, 1]
    proposer.start("r", [3, 1, 2])  # resumed after preemption: (1, 2) never occurred before in these tokens
    assert proposer.propose("r", 2) == []
    assert proposer.num_requests == 1


def test_requests_keep_separate_state():
    proposer = NgramProposer(2, 2)
    proposer.start("a", [1, 2, 9, 1, 2])
    proposer.start("b", [5, 1, 2])
    assert proposer.propose("a", 1) == [9]
    assert proposer.propose("b", 1) == []
    proposer.extend("b", [8, 1, 2])
    assert proposer.propose("a", 1) == [9]
    assert proposer.propose("b", 1) == [8]


def test_finish_drops_the_state():
    proposer = NgramProposer(2, 2)
    proposer.start("a", [1, 2, 9, 1, 2])
    proposer.start("b", [1, 2, 9, 1, 2])
    assert proposer.num_requests == 2
    proposer.finish("a")
    assert proposer.num_requests == 1
    assert proposer.propose("a", 2) == []
    assert proposer.propose("b", 2) == [9, 1]
    proposer.extend("a", [9])  # a finished request's late tokens do not bring it back
    assert proposer.num_requests == 1
    assert proposer.propose("a", 2) == []


def test_unknown_ids_are_ignored():
    proposer = NgramProposer(2, 2)
    proposer.finish("nope")
    proposer.extend("nope", [1, 2, 1, 2])
    assert proposer.propose("nope", 4) == []
    assert proposer.num_requests == 0


@pytest.mark.parametrize("min_n,max_n", [(0, 2), (3, 2)])
def test_bad_lengths_are_refused(min_n, max_n):
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n, max_n)


# ---- random sequences against the scan ---------------------------------------------------------

SMALL_VOCAB = st.integers(min_value=0, max_value=3)  # few distinct tokens, so suffixes recur
OPS = st.lists(
    st.tuples(
        st.sampled_from(["extend", "extend", "extend", "start"]),
        st.sampled_from(["a", "b"]),
        st.lists(SMALL_VOCAB, max_size=12),
    ),
    max_size=25,
)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    min_n=st.integers(min_value=1, max_value=3),
    span=st.integers(min_value=0, max_value=3),
    prompts=st.tuples(st.lists(SMALL_VOCAB, max_size=30), st.lists(SMALL_VOCAB, max_size=30)),
    ops=OPS,
    max_num_tokens=st.integers(min_value=0, max_value=6),
)
def test_propose_matches_a_scan_after_any_start_and_extend(min_n, span, prompts, ops, max_num_tokens):
    max_n = min_n + span
    proposer = NgramProposer(min_n, max_n)
    expected_tokens = {"a": list(prompts[0]), "b": list(prompts[1])}
    for request_id, token_ids in expected_tokens.items():
        proposer.start(request_id, token_ids)
    for op, request_id, token_ids in ops:
        if op == "start":
            expected_tokens[request_id] = list(token_ids)
            proposer.start(request_id, token_ids)
        else:
            expected_tokens[request_id] += token_ids
            proposer.extend(request_id, token_ids)
        for rid, tokens in expected_tokens.items():
            assert proposer.propose(rid, max_num_tokens) == reference_drafts(tokens, min_n, max_n, max_num_tokens)
