"""Which replica a data-parallel router picks (`asyncpp.dp.placement`): the one that would sample a
new prompt's first token soonest."""

from __future__ import annotations

import math

import pytest

from asyncpp.dp.placement import CHARS_PER_TOKEN, ReplicaLoads, prompt_tokens

ALL_LIVE = [True, True]


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ([5, 6, 7], 3),
        ([], 1),
        ("a" * (3 * CHARS_PER_TOKEN + 1), 3),
        ("ab", 1),
        ([{"role": "system", "content": "x" * 8}, {"role": "user", "content": "y" * 12}], 20 // CHARS_PER_TOKEN),
        ([{"role": "user"}], 1),
        ([{"role": "user", "content": "z" * 9}, 7], 2),  # not all messages: its length
        (None, 1),  # not a prompt: the replica refuses it
        (12345, 1),
        ({"prompt": "x" * 40}, 1),
    ],
)
def test_prompt_tokens_exact_for_ids_estimated_for_text(prompt, tokens):
    assert prompt_tokens(prompt) == tokens


@pytest.mark.parametrize(("replicas", "budget"), [(0, 128), (2, 0), (-1, 5)])
def test_loads_refuse_no_replicas_or_no_budget(replicas, budget):
    with pytest.raises(ValueError, match="must be positive"):
        ReplicaLoads(replicas, budget)


def test_steps_to_first_token_counts_queued_tokens_over_the_room_decoders_leave():
    loads = ReplicaLoads(2, 128)
    assert loads.steps_to_first_token(0, 64) == 0.5
    loads.queued(0, 100)
    loads.queued(0, 92)
    loads.prefilled(0, 92)  # one decoding, 100 tokens still queued
    assert loads.queued_tokens == [100, 0] and loads.num_queued == [1, 0] and loads.num_decoding == [1, 0]
    assert loads.steps_to_first_token(0, 27) == 1.0  # (100 + 27) / (128 - 1)
    for _ in range(127):
        loads.queued(1, 1)
        loads.prefilled(1, 1)
    assert loads.steps_to_first_token(1, 1) == 1.0  # one token of room left
    loads.queued(1, 1)
    loads.prefilled(1, 1)
    assert loads.steps_to_first_token(1, 1) == math.inf  # full: as many decoding as its budget
    loads.queued(1, 1)
    loads.prefilled(1, 1)
    assert loads.steps_to_first_token(1, 1) == math.inf


def test_equal_loads_take_turns_and_dead_replicas_are_skipped():
    loads = ReplicaLoads(3, 128)
    assert [loads.choose([True] * 3, 10) for _ in range(4)] == [0, 1, 2, 0]  # nothing recorded: all equal
    assert loads.choose([False, True, False], 10) == 1
    assert loads.choose([True, False, False], 10) == 0
    assert loads.choose([False, False, False], 10) is None


def test_a_prompt_goes_where_no_prompt_is_queued_even_past_more_requests():
    loads = ReplicaLoads(2, 128)
    for _ in range(2):  # replica 0: two requests decoding
        loads.queued(0, 1000)
        loads.prefilled(0, 1000)
    loads.queued(1, 1000)  # replica 1: one long prompt prefilling
    assert [loads.num_unfinished(i) for i in (0, 1)] == [2, 1]
    assert loads.choose(ALL_LIVE, 1000) == 0  # 1000 / 126 steps against 2000 / 128
    assert loads.choose(ALL_LIVE, 1000) == 0  # choosing records nothing: the caller does
    loads.queued(0, 1000)
    assert loads.choose(ALL_LIVE, 1000) == 1  # now 2000 / 126 against 2000 / 128


def test_equal_waits_go_to_fewer_unfinished_then_in_turn():
    loads = ReplicaLoads(2, 128)
    loads.queued(1, 50)
    loads.prefilled(1, 50)
    loads.queued(0, 50)
    loads.ended(0, 50, was_prefilled=False)  # replica 0: nothing; replica 1: one decoding
    assert loads.queued_tokens == [0, 0] and [loads.num_unfinished(i) for i in (0, 1)] == [0, 1]
    # 64 / 128 against 64 / 127: replica 0, and again after it (its _next points at replica 1)
    assert loads.choose(ALL_LIVE, 64) == 0 and loads.choose(ALL_LIVE, 64) == 0
    loads.ended(1, 50, was_prefilled=True)
    assert loads.num_decoding == [0, 0] and loads.choose(ALL_LIVE, 64) == 1  # equal: in turn from replica 1


def test_full_replicas_fall_back_to_fewer_unfinished():
    loads = ReplicaLoads(2, 2)
    for replica, requests in ((0, 3), (1, 2)):
        for _ in range(requests):
            loads.queued(replica, 5)
            loads.prefilled(replica, 5)
    assert loads.steps_to_first_token(0, 5) == loads.steps_to_first_token(1, 5) == math.inf
    assert loads.choose(ALL_LIVE, 5) == 1 and loads.choose(ALL_LIVE, 5) == 1
    loads.queued(1, 5)
    assert loads.choose(ALL_LIVE, 5) == 0  # 3 unfinished against 3: in turn (after replica 1)
