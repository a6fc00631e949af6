"""The sampled tokens' way from the last stage to the first (async scheduling, pp_size > 1).

`TokenOutbox` (last stage) sends one `SampledTokens` per step, failed or not:
the latest token of each request that sampled (host path), or, with a token
ring (`asyncpp.transport.token_ring`), the ring slot its tokens were written
to on the device, as soon as the sampler has drawn them (`ModelRunner.on_sampled`).
Steps the ring does not take (drafts, logprobs, penalties, seeds) go the host path.

`TokenInbox` (first stage) takes them in step order before each plan: those
of the plan's `after_step_id` (blocking: its placeholders need them), every one
that has arrived, and with a ring every one up to `step_id - num_slots`, so
that the slot the last stage writes next is free (the token ring's reuse rule).
"""

from __future__ import annotations

import torch

from asyncpp.core.plan import StepPlan
from asyncpp.transport.token_ring import TokenRingReader, TokenRingWriter
from asyncpp.wire.queues import PullQueue, PushQueue
from asyncpp.wire.stage_msgs import SampledTokens
from asyncpp.worker.model_runner import ModelRunner
from asyncpp.worker.outputs import ModelRunnerOutput


class TokenOutbox:
    def __init__(self, queue: PushQueue, writer: TokenRingWriter | None = None) -> None:
        self.queue = queue
        self.writer = writer
        self.sent_step_id = -1  # the latest step whose tokens went out (a step sends once)

    def attach(self, runner: ModelRunner) -> None:
        """With a ring, `runner` hands each step's tokens here while they are still on the device."""
        if self.writer is not None:
            runner.on_sampled = self.send_on_device

    def send_on_device(self, step_id: int, req_ids: list[str], token_ids: torch.Tensor) -> None:
        slot = self.writer.write(step_id, token_ids)
        self._put(SampledTokens(step_id, list(req_ids), slot=slot))

    def send(self, step_id: int, output: ModelRunnerOutput) -> None:
        """The step's tokens from its output, unless they went out on the device already."""
        if self.sent_step_id != step_id:
            latest = [ids[-1] for ids in output.sampled_token_ids]
            self._put(SampledTokens(step_id, output.req_ids, latest, output.draft_token_ids))

    def send_failed(self, step_id: int) -> None:
        """A failed step: no tokens, but the first stage must not wait for them."""
        if self.sent_step_id != step_id:
            self._put(SampledTokens(step_id))

    def _put(self, msg: SampledTokens) -> None:
        self.queue.put(msg)
        self.sent_step_id = msg.step_id

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.queue.close()


class TokenInbox:
    def __init__(self, queue: PullQueue, reader: TokenRingReader | None = None) -> None:
        self.queue = queue
        self.reader = reader
        self.last_step_id = -1  # the latest step whose tokens are in
        self.first_step_id: int | None = None  # the first plan this stage ran (the last stage's first too)
        self.num_on_device = self.num_on_host = 0  # steps whose tokens came through the ring, in messages

    def take(self, runner: ModelRunner, plan: StepPlan) -> None:
        """Record what has arrived; block until the tokens `plan` needs (and, with a ring, those of
        every step up to `plan.step_id - num_slots`) are in."""
        if self.first_step_id is None:
            self.first_step_id = plan.step_id
        target = -1 if plan.after_step_id is None else plan.after_step_id
        if self.reader is not None and plan.step_id - self.reader.spec.num_slots >= self.first_step_id:
            target = max(target, plan.step_id - self.reader.spec.num_slots)
        while self.last_step_id < target or self.queue.has_message():
            msg = self.queue.get()
            if msg.slot >= 0:
                runner.record_on_device(msg.step_id, msg.req_ids, self.reader.take(msg.step_id, msg.slot, len(msg.req_ids)))
                self.num_on_device += 1
            elif msg.req_ids:
                runner.record_sampled(msg.req_ids, msg.token_ids, msg.draft_token_ids)
                self.num_on_host += 1
            self.last_step_id = msg.step_id

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.queue.close()
