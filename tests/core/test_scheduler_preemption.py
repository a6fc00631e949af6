"""Preemption under a tiny KV cache loses and corrupts nothing.

20 requests run through a fake paged-KV model (outputs depend on the KV read
back through the block tables) with far too few blocks, so requests are
preempted and recomputed, sometimes restarting from prefix-cache hits. Every
request must end with exactly the output and finish reason it gets alone.
"""

from __future__ import annotations

import random

import pytest
from sched_helpers import FakeKVModel, drive, drive_async, make_request, solo_output

from asyncpp.core.request import Request
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
NUM_BLOCKS = 16  # 64 tokens: the cache holds barely one long request


def _requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    shared_prefix = [rng.randrange(97) for _ in range(12)]
    requests = []
    for i in range(20):
        num_prompt = rng.randrange(5, 31)
        prompt = [rng.randrange(97) for _ in range(num_prompt)]
        if i % 3 == 0:  # some share a prefix, so recomputes and newcomers hit the cache
            prompt = shared_prefix + prompt[: max(1, num_prompt - 12)]
        params: dict[str, object] = {"max_tokens": rng.randrange(5, MAX_MODEL_LEN - len(prompt) + 8)}
        if i % 5 == 1:
            params["stop_token_ids"] = [rng.randrange(97)]
        requests.append(make_request(f"r{i}", prompt, eos_token_id=(7 if i % 4 == 2 else None), **params))
    return requests


@pytest.mark.parametrize(
    ("max_in_flight", "enable_chunked_prefill", "enable_prefix_caching"),
    [(1, True, True), (3, True, True), (3, False, True), (3, True, False)],
)
def test_preempted_requests_finish_exactly_as_when_run_alone(
    max_in_flight: int, enable_chunked_prefill: bool, enable_prefix_caching: bool
) -> None:
    requests = _requests(seed=1234)
    expected = {r.request_id: solo_output(r, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN) for r in requests}
    block_manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    scheduler = Scheduler(
        block_manager,
        max_num_seqs=8,
        max_num_batched_tokens=24 if enable_chunked_prefill else MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    for request in requests:
        scheduler.add_request(request)
    drive(scheduler, FakeKVModel(NUM_BLOCKS, BLOCK_SIZE), max_in_flight=max_in_flight, rng=random.Random(7))

    assert sum(r.num_preemptions for r in requests) > 0  # the cache really was too small
    assert scheduler.stats().num_preemptions == sum(r.num_preemptions for r in requests)
    for request in requests:
        assert request.is_finished and request.status.finish_reason in ("stop", "length")
        assert request.output_token_ids == expected[request.request_id], request.request_id
    assert block_manager.num_free_blocks == NUM_BLOCKS and scheduler.kv_usage == 0.0
    assert scheduler.num_in_flight_steps == 0 and not scheduler.has_unfinished_requests()
    if enable_prefix_caching:
        assert block_manager.num_prefix_cache_hit_tokens > 0


@pytest.mark.parametrize(
    ("max_cohorts", "num_blocks", "enable_prefix_caching", "min_prefill_share"),
    [
        (1, NUM_BLOCKS, True, None),
        (2, NUM_BLOCKS, True, None),
        (2, NUM_BLOCKS, True, 2),
        (3, NUM_BLOCKS, False, 2),
        (2, 256, True, None),
        (3, 256, True, 3),
    ],
)
def test_async_scheduling_finishes_every_request_exactly_as_when_run_alone(
    max_cohorts: int, num_blocks: int, enable_prefix_caching: bool, min_prefill_share: int | None
) -> None:
    """Plans scheduled before the tokens they compute were sampled (placeholders), prompts split
    over the cohorts' plans, under preemption (a tiny cache) and without it: same outputs, no
    block or request left behind."""
    requests = _requests(seed=99)
    expected = {r.request_id: solo_output(r, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN) for r in requests}
    block_manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    scheduler = Scheduler(
        block_manager, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=MAX_MODEL_LEN, async_scheduling=True
    )
    for request in requests:
        scheduler.add_request(request)
    num_plans, num_placeholders = drive_async(
        scheduler, FakeKVModel(num_blocks, BLOCK_SIZE), max_cohorts=max_cohorts, min_prefill_share=min_prefill_share
    )

    if num_blocks == NUM_BLOCKS:
        assert sum(r.num_preemptions for r in requests) > 0
    for request in requests:
        assert request.is_finished and request.status.finish_reason in ("stop", "length")
        assert request.output_token_ids == expected[request.request_id], request.request_id
    assert block_manager.num_free_blocks == num_blocks and scheduler.kv_usage == 0.0
    assert scheduler.num_in_flight_steps == 0 and not scheduler.has_unfinished_requests()
    assert num_placeholders > num_plans / 4, (num_placeholders, num_plans)  # most decodes ran ahead
