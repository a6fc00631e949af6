"""Test doubles for the scheduler: a fake paged-KV "model" and a pipelined driver loop.

`FakeKVModel` writes every scheduled token into its own paged cache through
the plan's block table and computes the next token only from what it reads
back through that table, like real attention. A wrong block table, a prefix
hit on stale content or a block reused while still owned changes the output,
so comparing outputs against a solo run catches corrupted requests.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from typing import Callable

from asyncpp.core.plan import PLACEHOLDER_TOKEN_ID, StepPlan
from asyncpp.core.prefill_share import num_prefill_tokens, prefill_share
from asyncpp.core.request import Request
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager
from asyncpp.sampling.params import SamplingParams

VOCAB_SIZE = 97


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    eos_token_id: int | None = None,
    **params: object,
) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_id=eos_token_id,
    )


def next_token(context: list[int]) -> int:
    """The fake model: position-weighted sum of the whole context, mod the vocabulary."""
    return sum((position + 1) * token for position, token in enumerate(context)) % VOCAB_SIZE


class FakeKVModel:
    """Executes plans in step order against a paged KV store; also tracks the runner's request state."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.known_request_ids: set[str] = set()

    def execute(self, plan: StepPlan) -> dict[str, list[int]]:
        self.known_request_ids -= set(plan.finished_req_ids)
        for new in plan.new_requests:
            self.known_request_ids.add(new.request_id)
        # Like attention: every new token's KV is written before any is read.
        for scheduled in plan.scheduled:
            assert scheduled.request_id in self.known_request_ids, "runner never got this request"
            end = scheduled.start_position + scheduled.num_tokens
            assert len(scheduled.block_ids) * self.block_size >= end, "block table too short"
            for offset, token in enumerate(scheduled.token_ids):
                position = scheduled.start_position + offset
                self.kv[scheduled.block_ids[position // self.block_size]][position % self.block_size] = token
        sampled: dict[str, list[int]] = {}
        for scheduled in plan.scheduled:
            if scheduled.do_sample:
                end = scheduled.start_position + scheduled.num_tokens
                context = [
                    self.kv[scheduled.block_ids[p // self.block_size]][p % self.block_size] for p in range(end)
                ]
                assert None not in context, "read an unwritten KV slot"
                sampled[scheduled.request_id] = [next_token(context)]  # type: ignore[arg-type]
        return sampled


def drive(
    scheduler: Scheduler,
    model: FakeKVModel,
    *,
    max_in_flight: int,
    rng: random.Random | None = None,
    max_steps: int = 100_000,
    on_plan: Callable[[StepPlan, list[StepPlan]], None] | None = None,
) -> int:
    """Run until no request is left: keep up to `max_in_flight` plans out, complete them in random order.

    Plans execute at dispatch, in step order, as the stages would. Returns the
    number of plans. Fails on a deadlock (work left, nothing schedulable, nothing in flight).
    """
    in_flight: list[tuple[StepPlan, dict[str, list[int]]]] = []
    num_plans = 0
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < max_in_flight:
            plan = scheduler.schedule()
            if plan is None:
                break
            if on_plan is not None:
                on_plan(plan, [p for p, _ in in_flight])
            in_flight.append((plan, model.execute(plan)))
            num_plans += 1
        assert in_flight, "deadlock: unfinished requests but nothing schedulable or in flight"
        index = rng.randrange(len(in_flight)) if rng is not None else 0
        plan, sampled = in_flight.pop(index)
        scheduler.update_from_output(plan, sampled)
        assert num_plans < max_steps, "did not finish"
    return num_plans


def drive_async(
    scheduler: Scheduler,
    model: FakeKVModel,
    *,
    max_cohorts: int,
    min_prefill_share: int | None = None,
    max_steps: int = 100_000,
    restart_after: frozenset[int] = frozenset(),
) -> tuple[int, int]:
    """Run until no request is left with async scheduling, like the pipeline engine (minus its spacing).

    Up to `max_cohorts` cohorts, each with up to two plans out: a new cohort
    first, else the next plan of the cohort dispatched longest ago, scheduled
    after its plan in flight. Plans execute at dispatch in step order with
    their placeholders replaced by the latest sampled tokens (the first
    stage's job) and come back in step order. With `min_prefill_share`, each
    plan takes at most its cohort's share of the pending prompt tokens (at
    least that many). After each plan numbered in `restart_after` is dispatched,
    the stages restart: a fresh model (no KV, no request known), the plans in
    flight dropped, `Scheduler.recompute_all`. Returns the number of plans and
    of placeholders filled.
    """
    latest: dict[str, int] = {}
    in_flight: collections.deque[tuple[StepPlan, dict[str, list[int]]]] = collections.deque()
    cohorts: list[list[int]] = []
    last_prefill = [0]  # prompt tokens of the plan dispatched last

    def next_plan() -> StepPlan | None:
        size = max(1, math.ceil((scheduler.num_running + scheduler.num_waiting) / max_cohorts))
        share = None
        if min_prefill_share is not None:  # the engine's policy, with the given minimum
            share = max(min_prefill_share, prefill_share(scheduler.num_pending_prefill_tokens, max_cohorts, last_prefill[0]))
        if len(cohorts) < max_cohorts:
            if (plan := scheduler.schedule(max_num_reqs=size, max_num_prefill_tokens=share)) is not None:
                cohorts.append([plan.step_id])
                return plan
        for cohort in sorted((c for c in cohorts if len(c) == 1), key=lambda c: c[0]):
            plan = scheduler.schedule(max_num_reqs=size, after_step_id=cohort[0], max_num_prefill_tokens=share)
            if plan is not None:
                cohort.append(plan.step_id)
                return plan
        return None

    num_plans = num_placeholders = 0
    while scheduler.has_unfinished_requests() or in_flight:
        while (plan := next_plan()) is not None:
            last_prefill[0] = num_prefill_tokens(plan)
            filled = [
                dataclasses.replace(s, token_ids=[latest[s.request_id]])
                if s.token_ids == [PLACEHOLDER_TOKEN_ID]
                else s
                for s in plan.scheduled
            ]
            num_placeholders += sum(s.token_ids == [PLACEHOLDER_TOKEN_ID] for s in plan.scheduled)
            assert (plan.after_step_id is not None) == any(
                s.token_ids == [PLACEHOLDER_TOKEN_ID] for s in plan.scheduled
            ), "after_step_id set exactly when the plan has placeholders"
            sampled = model.execute(dataclasses.replace(plan, scheduled=filled))
            latest.update((request_id, tokens[-1]) for request_id, tokens in sampled.items())
            in_flight.append((plan, sampled))
            num_plans += 1
            if num_plans in restart_after:
                assert scheduler.recompute_all().num_discarded_steps == len(in_flight)
                model, latest, cohorts = FakeKVModel(len(model.kv), model.block_size), {}, []
                in_flight.clear()
        assert in_flight, "deadlock: unfinished requests but nothing schedulable or in flight"
        plan, sampled = in_flight.popleft()
        cohort = next(c for c in cohorts if c[0] == plan.step_id)
        cohort.pop(0)
        if not cohort:
            cohorts.remove(cohort)
        scheduler.update_from_output(plan, sampled)
        assert num_plans < max_steps, "did not finish"
    return num_plans, num_placeholders


def solo_output(request: Request, *, block_size: int, max_model_len: int) -> list[int]:
    """Output tokens of a copy of `request` run alone with a cache far larger than it needs."""
    num_blocks = 4 * max_model_len // block_size + 4
    scheduler = Scheduler(
        BlockManager(num_blocks, block_size),
        max_num_seqs=1,
        max_num_batched_tokens=max_model_len,
        max_model_len=max_model_len,
    )
    copy = Request(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        eos_token_id=request.eos_token_id,
    )
    scheduler.add_request(copy)
    drive(scheduler, FakeKVModel(num_blocks, block_size), max_in_flight=1)
    return copy.output_token_ids
