"""The token ring's parts (`asyncpp.transport.token_ring`, `asyncpp.runtime.token_handoff`) on CPU:
a step's tokens written and taken back through a shared-memory ring, the first stage's reuse rule
(it takes every notice up to `step_id - num_slots` before a plan), one notice per step from the
last stage, and the runner handing a draw on while still on the device only when it may."""

from __future__ import annotations

import uuid

import pytest
import torch

from asyncpp.core.plan import StepPlan
from asyncpp.engine.engine import Engine
from asyncpp.runtime.token_handoff import TokenInbox, TokenOutbox
from asyncpp.sampling.params import SamplingParams
from asyncpp.transport import ActivationError
from asyncpp.transport.token_ring import TokenRingReader, TokenRingWriter, token_ring_spec
from asyncpp.wire.stage_msgs import SampledTokens
from asyncpp.worker.outputs import ModelRunnerOutput
from tests.conftest import tiny_config, tiny_prompts


@pytest.fixture
def ring():
    spec = token_ring_spec(f"asyncpp-test-{uuid.uuid4().hex[:8]}", "shm", 3, 4, "cpu", "cpu")
    reader = TokenRingReader(spec)
    writer = TokenRingWriter(reader.spec)
    yield reader, writer
    writer.close()
    reader.close()


def test_tokens_round_trip_and_a_step_too_big_is_refused(ring):
    reader, writer = ring
    slot = writer.write(7, torch.tensor([5, 6, 7], dtype=torch.int64))
    assert slot == 7 % 3
    taken = reader.take(7, slot, 3)
    writer.write(10, torch.tensor([9, 9, 9], dtype=torch.int64))  # the same slot, written again
    assert taken.tolist() == [5, 6, 7]  # a copy of its own: the slot may be rewritten after `take`
    with pytest.raises(ActivationError, match="do not fit"):
        writer.write(8, torch.arange(5))


class FakeQueue:
    """Messages in order; `has_message` only for those marked arrived (the rest come on `get`)."""

    def __init__(self, msgs, num_arrived=0) -> None:
        self.msgs, self.num_arrived, self.closed = list(msgs), num_arrived, False

    def has_message(self) -> bool:
        return self.num_arrived > 0 and bool(self.msgs)

    def get(self):
        self.num_arrived -= 1
        msg = self.msgs.pop(0)
        return msg() if callable(msg) else msg  # a callable: the last stage writes and sends only now

    def put(self, msg) -> None:
        self.msgs.append(msg)

    def close(self) -> None:
        self.closed = True


class FakeRunner:
    def __init__(self) -> None:
        self.on_device, self.on_host, self.on_sampled = [], [], None

    def record_on_device(self, step_id, req_ids, token_ids) -> None:
        self.on_device.append((step_id, req_ids, token_ids.tolist()))

    def record_sampled(self, req_ids, token_ids, drafts=None) -> None:
        self.on_host.append((req_ids, token_ids, drafts))


def test_inbox_takes_what_a_plan_needs_and_frees_the_slots_the_last_stage_writes_next(ring):
    reader, writer = ring

    def on_device(step: int):
        return lambda: SampledTokens(step, ["r"], slot=writer.write(step, torch.tensor([step * 10])))

    msgs = [on_device(s) if s % 2 else SampledTokens(s, ["r"], [s * 10], [[s]]) for s in range(5, 12)]
    runner, inbox = FakeRunner(), TokenInbox(FakeQueue(msgs), reader)
    inbox.take(runner, StepPlan(5, []))  # the first plan: nothing before it to wait for
    assert inbox.first_step_id == 5 and inbox.last_step_id == -1
    inbox.take(runner, StepPlan(8, []))  # 8 - 3 slots: step 5's slot is the one step 8 writes
    assert inbox.last_step_id == 5
    inbox.take(runner, StepPlan(9, []))
    assert inbox.last_step_id == 6
    assert runner.on_device == [(5, ["r"], [50])] and runner.on_host == [(["r"], [60], [[6]])]
    inbox.take(runner, StepPlan(10, [], after_step_id=8))  # its placeholders: step 8's tokens
    assert inbox.last_step_id == 8 and runner.on_device[-1] == (7, ["r"], [70])
    inbox.queue.num_arrived = 1  # step 9's notice is in: taken with the next plan, unasked
    inbox.take(runner, StepPlan(11, []))
    assert inbox.last_step_id == 9 and (inbox.num_on_device, inbox.num_on_host) == (3, 2)


def test_inbox_without_a_ring_waits_only_for_the_placeholders():
    msgs = [SampledTokens(s, ["r"], [s]) for s in range(6)]
    runner, inbox = FakeRunner(), TokenInbox(FakeQueue(msgs))
    inbox.take(runner, StepPlan(0, []))
    inbox.take(runner, StepPlan(5, []))
    assert inbox.last_step_id == -1
    inbox.take(runner, StepPlan(6, [], after_step_id=2))
    assert inbox.last_step_id == 2


def test_outbox_sends_one_notice_per_step(ring):
    reader, writer = ring
    queue, runner = FakeQueue([]), FakeRunner()
    outbox = TokenOutbox(queue, writer)
    outbox.attach(runner)
    runner.on_sampled(4, ["a", "b"], torch.tensor([1, 2]))
    outbox.send(4, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[1], [2]]))
    outbox.send_failed(4)  # a failure after the tokens went out: nothing more
    outbox.send(5, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[3, 4, 8]], draft_token_ids=[[9]]))
    outbox.send_failed(6)
    assert queue.msgs == [
        SampledTokens(4, ["a", "b"], slot=1),
        SampledTokens(5, ["a"], [8], [[9]]),
        SampledTokens(6),
    ]
    assert reader.take(4, 1, 2).tolist() == [1, 2]
    host_only = TokenOutbox(FakeQueue([]))
    host_only.attach(runner := FakeRunner())
    host_only.close()
    assert runner.on_sampled is None and host_only.queue.closed


@pytest.mark.parametrize("logprobs,on_device", [(None, True), (1, False)])
def test_runner_hands_a_draw_on_only_when_the_host_adds_nothing(tiny_hf_dir, logprobs, on_device):
    engine = Engine(tiny_config(tiny_hf_dir))
    runner = engine.executor.runners[0]
    handed = []
    runner.on_sampled = lambda step_id, req_ids, token_ids: handed.append((step_id, list(req_ids), token_ids.tolist()))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    results = engine.generate(tiny_prompts(322, 2), params)
    if not on_device:
        assert handed == []
        return
    assert len(handed) == 3  # one per step: both requests decode together
    by_request: dict[str, list[int]] = {}
    for _, req_ids, token_ids in handed:
        for req_id, token_id in zip(req_ids, token_ids):
            by_request.setdefault(req_id, []).append(token_id)
    assert sorted(by_request.values()) == sorted(r.token_ids for r in results)
