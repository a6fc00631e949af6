"""The async decode fast path (`Scheduler._continue_decoding`) schedules exactly what the general
path schedules: the same plans, step by step, across block boundaries, preemption, requests
finished in flight (as a stop string finishes them) and token-level stops."""

from __future__ import annotations

import random

import pytest
from sched_helpers import FakeKVModel, drive_async, make_request

from asyncpp.core.plan import StepPlan
from asyncpp.core.request import RequestStatus
from asyncpp.core.scheduler import Scheduler
from asyncpp.core.step_builder import StepBuilder
from asyncpp.kv.block_manager import BlockManager

MAX_MODEL_LEN = 64


def _run(seed: int, *, use_fast_path: bool) -> tuple[list[StepPlan], dict[str, list[int]], int, int]:
    """Plans and outputs of one random async workload; how many entries the fast path made; the block size."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = MAX_MODEL_LEN // block_size + rng.choice([0, 4, 64])  # small: preemption
    scheduler = Scheduler(
        BlockManager(num_blocks, block_size, enable_prefix_caching=rng.random() < 0.7),
        max_num_seqs=rng.randrange(2, 9),
        max_num_batched_tokens=rng.randrange(8, 40),
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=True,
    )
    requests = [
        make_request(
            f"r{i}",
            [rng.randrange(97) for _ in range(rng.randrange(1, 24))],
            eos_token_id=rng.choice([None, 5]),
            max_tokens=rng.randrange(1, 30),
        )
        for i in range(rng.randrange(4, 12))
    ]
    for request in requests:
        scheduler.add_request(request)

    plans: list[StepPlan] = []
    num_fast = 0
    schedule, update, continue_decoding = scheduler.schedule, scheduler.update_from_output, scheduler._continue_decoding

    def recorded_schedule(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        if plan is not None:
            plans.append(plan)
        return plan

    def counted_continue(*args):
        nonlocal num_fast
        if not use_fast_path:
            return False
        taken = continue_decoding(*args)
        num_fast += taken
        return taken

    def update_then_stop_strings(plan, sampled, *args):
        updates = update(plan, sampled, *args)
        # A "stop string": the engine finishes the request after seeing this token, maybe while
        # its next plan is in flight.
        stopped = [u.request_id for u in updates if u.new_token_ids and u.new_token_ids[-1] % 13 == 0]
        scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return updates

    scheduler.schedule, scheduler.update_from_output = recorded_schedule, update_then_stop_strings
    scheduler._continue_decoding = counted_continue
    drive_async(scheduler, FakeKVModel(num_blocks, block_size), max_cohorts=rng.choice([1, 2, 3]))
    return plans, {r.request_id: r.output_token_ids for r in requests}, num_fast, block_size


@pytest.mark.parametrize("seed", range(12))
def test_fast_path_plans_equal_the_general_paths(seed: int) -> None:
    fast_plans, fast_outputs, num_fast, block_size = _run(seed, use_fast_path=True)
    slow_plans, slow_outputs, _, _ = _run(seed, use_fast_path=False)
    assert len(fast_plans) == len(slow_plans)
    for fast, slow in zip(fast_plans, slow_plans):
        assert fast == slow, fast.step_id
    assert fast_outputs == slow_outputs
    assert num_fast > 0 or block_size == 1  # (with one-token blocks every decode step needs a new block)


def test_the_fast_path_leaves_block_boundaries_to_the_general_path() -> None:
    """A continuation whose next token starts a new block is not taken by the fast path."""
    scheduler = Scheduler(BlockManager(16, 2), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16, async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    first = scheduler.schedule()  # the prompt: 3 tokens, 2 blocks; samples token 4
    step = scheduler.schedule(after_step_id=first.step_id)  # placeholder at position 3: block 1 covers it
    assert step.scheduled[0].block_ids == first.scheduled[0].block_ids
    scheduler.update_from_output(first, {"a": [7]})
    request = scheduler.get_request("a")
    builder = StepBuilder(99, 16, None, 16)
    # Position 4 needs a third block: not the fast path's.
    assert not scheduler._continue_decoding(request, step.step_id, builder) and not builder.scheduled
