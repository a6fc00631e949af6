"""Randomized workload: arrivals, aborts, in-flight windows, cohort caps, completion order
and failed (rolled back) steps vary per step.

Checked after every action: no request in two in-flight plans, plan limits,
block ref counts equal table membership, free + used == num_blocks, only
running requests hold blocks. At the end every request has finished, the
cache is empty, and each non-aborted request's output equals its solo run
(an aborted one's output is a prefix of it).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from sched_helpers import FakeKVModel, make_request, solo_output

from asyncpp.core.plan import StepPlan
from asyncpp.core.request import Request, RequestStatus
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager

MAX_MODEL_LEN = 48
NUM_STEPS = 300
NUM_ARRIVAL_STEPS = 200


class _Harness:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.block_size = rng.choice([2, 4, 8])
        self.num_blocks = MAX_MODEL_LEN // self.block_size + rng.randrange(0, 16)
        self.max_num_seqs = rng.randrange(1, 9)
        self.enable_chunked_prefill = rng.random() < 0.75
        budget = rng.randrange(4, 64)
        self.max_num_batched_tokens = budget if self.enable_chunked_prefill else max(budget, MAX_MODEL_LEN)
        self.bm = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching=rng.random() < 0.8)
        self.scheduler = Scheduler(
            self.bm,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        self.model = FakeKVModel(self.num_blocks, self.block_size)
        self.requests: dict[str, Request] = {}
        self.live: list[Request] = []  # unfinished, plus any finished since the last check_state
        self.aborted_ids: set[str] = set()
        self.in_flight: list[tuple[StepPlan, dict[str, list[int]]]] = []
        self.next_step_id = 0
        self.prefixes = [[rng.randrange(97) for _ in range(16)] for _ in range(3)]

    def add_random_request(self) -> None:
        rng = self.rng
        request_id = f"r{len(self.requests)}"
        num_prompt = rng.randrange(1, 40)
        prompt = [rng.randrange(97) for _ in range(num_prompt)]
        if rng.random() < 0.4:
            prompt = (rng.choice(self.prefixes) + prompt)[:num_prompt]
        params: dict[str, object] = {"max_tokens": rng.randrange(1, MAX_MODEL_LEN - num_prompt + 6)}
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(97)]
        if rng.random() < 0.2:
            params["ignore_eos"] = True
        request = make_request(request_id, prompt, eos_token_id=rng.choice([None, 3]), **params)
        self.requests[request_id] = request
        self.live.append(request)
        self.scheduler.add_request(request)

    def abort_random_request(self) -> None:
        live = [r.request_id for r in self.requests.values() if not r.is_finished]
        in_flight = [i for i in live if self.requests[i].is_in_flight]
        if in_flight and self.rng.random() < 0.5:  # the interesting case: its output is still coming
            live = in_flight
        if live:
            request_id = self.rng.choice(live)
            (finished,) = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            assert finished is self.requests[request_id]
            self.aborted_ids.add(request_id)

    def dispatch(self, max_in_flight: int) -> None:
        while len(self.in_flight) < max_in_flight:
            max_num_reqs = self.rng.choice([None, None, 1, 2, 3])  # the pipeline caps cohorts
            plan = self.scheduler.schedule(max_num_reqs=max_num_reqs)
            if plan is None:
                return
            assert max_num_reqs is None or plan.num_reqs <= max_num_reqs
            self.check_plan(plan)
            self.in_flight.append((plan, self.model.execute(plan)))

    def complete_one(self, failure_rate: float = 0.0) -> None:
        plan, sampled = self.in_flight.pop(self.rng.randrange(len(self.in_flight)))
        if self.rng.random() < failure_rate:
            sampled = {}  # a failed step: its requests are rolled back and recomputed
        self.scheduler.update_from_output(plan, sampled)

    def check_plan(self, plan: StepPlan) -> None:
        assert plan.step_id == self.next_step_id
        self.next_step_id += 1
        ids = [s.request_id for s in plan.scheduled]
        assert len(ids) == len(set(ids)), "a request twice in one plan"
        busy = {s.request_id for p, _ in self.in_flight for s in p.scheduled}
        assert not busy & set(ids), "a request in two in-flight plans"
        assert 0 < plan.num_tokens <= self.max_num_batched_tokens
        assert plan.num_reqs <= self.max_num_seqs
        for scheduled in plan.scheduled:
            request = self.requests[scheduled.request_id]
            end = scheduled.start_position + scheduled.num_tokens
            assert request.is_in_flight and request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens == end and scheduled.num_tokens > 0
            assert scheduled.token_ids == request.all_token_ids[scheduled.start_position : end]
            assert scheduled.do_sample == (end == request.num_tokens)
            assert len(scheduled.block_ids) * self.block_size >= end
            assert scheduled.block_ids == self.bm.block_ids(scheduled.request_id)
        for new in plan.new_requests:
            request = self.requests[new.request_id]
            assert new.request_id in ids
            assert new.prompt_token_ids == request.prompt_token_ids
            assert new.output_token_ids == request.output_token_ids
        for request_id in plan.finished_req_ids:
            assert self.requests[request_id].is_finished, "a preempted or live request reported finished"

    def check_state(self) -> None:
        still_live = []
        block_counts: Counter[int] = Counter()
        for request in self.live:
            assert request.num_computed_tokens <= request.num_tokens <= MAX_MODEL_LEN + 1
            if request.status is RequestStatus.RUNNING:
                block_counts.update(self.bm.block_ids(request.request_id))
            else:
                assert self.bm.block_ids(request.request_id) == [], "only running requests hold blocks"
            if not request.is_finished:
                still_live.append(request)
        self.live = still_live  # a finished request was checked once above, after it finished
        for block_id in range(self.num_blocks):
            assert self.bm.ref_count(block_id) == block_counts[block_id]
        num_used = sum(1 for b in range(self.num_blocks) if self.bm.ref_count(b) > 0)
        assert self.bm.num_free_blocks + num_used == self.num_blocks
        num_running = sum(1 for r in self.live if r.status is RequestStatus.RUNNING)
        assert self.scheduler.num_running == num_running <= self.max_num_seqs
        assert self.scheduler.num_running + self.scheduler.num_waiting == len(self.live)
        assert self.scheduler.num_in_flight_steps == len(self.in_flight)

@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_invariants_and_finishes_everything(seed: int) -> None:
    rng = random.Random(seed)
    h = _Harness(rng)
    for step in range(NUM_STEPS):
        if step < NUM_ARRIVAL_STEPS and rng.random() < 0.3:
            for _ in range(rng.randrange(1, 3)):
                h.add_random_request()
        if rng.random() < 0.05:
            h.abort_random_request()
            h.check_state()
        h.dispatch(max_in_flight=rng.randrange(1, 5))
        h.check_state()
        if h.in_flight and rng.random() < 0.8:
            h.complete_one(failure_rate=0.03)
            h.check_state()
    for _ in range(10_000):  # drain: no new arrivals or aborts
        if not (h.scheduler.has_unfinished_requests() or h.in_flight):
            break
        h.dispatch(max_in_flight=3)
        assert h.in_flight, "deadlock: unfinished requests but nothing schedulable or in flight"
        h.complete_one()
        h.check_state()
    assert not h.scheduler.has_unfinished_requests() and not h.in_flight
    assert all(r.is_finished for r in h.requests.values())
    assert h.bm.num_free_blocks == h.num_blocks and h.scheduler.kv_usage == 0.0
    assert len(h.requests) > 20
    for request_id, request in h.requests.items():
        expected = solo_output(request, block_size=h.block_size, max_model_len=MAX_MODEL_LEN)
        if request_id in h.aborted_ids:
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected, request_id
