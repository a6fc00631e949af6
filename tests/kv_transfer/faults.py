"""Fault injection for the KV-transfer tests, selected by config alone (`kv_transfer.module`).

Works in-process and in stage processes alike: importing this module
registers the connectors and wraps three `ModelRunner` methods, which fail
only on a runner whose connector is a `FaultyWorker` that armed a fault for
the step it runs.

* `faulty`: the offload connector, plus `options`:
  - `fail_at`: where a step fails on stage `fail_pp_rank`: "load_start"
    (the connector's `start_load_kv` raises: pre_forward fails), "forward"
    (the model's forward raises), "sample" or "propose" (last stage only),
    "save_kv" (the connector's `save_kv` raises, after the forward);
  - `fail_on_save`: the step armed is this stage's n-th step with saves
    (1-based; default 1), or `fail_on_step` its n-th step with tokens, or
    with `fail_on_load` its first step with tokens that starts loads;
  - `save_fault` / `load_fault`: "raise" or "hang" (`hang_s` seconds,
    outside the cache guard, like a stuck disk), or "raise|hang" for either,
    for every save / load job on stage `fault_pp_rank` (None: every stage),
    from its `fault_after`-th job on (0-based; default 0); with `fault_rate`
    < 1 only for that share of them, drawn from `seed` (+ the stage's rank).
* `stuck`: moves nothing and never reports: with `load_blocks` > 0 it offers
  loads, it holds every finished request's blocks for a "send", and with
  `ask_again_token` it answers "ask again later" for prompts starting with
  that token. Only the engine's deadlines end its transfers.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from asyncpp.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, PlanInfo
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata
from asyncpp.kv_transfer.offload.scheduler import OffloadScheduler
from asyncpp.kv_transfer.offload.worker import OffloadWorker
from asyncpp.kv_transfer.registry import register_connector
from asyncpp.worker.model_runner import ModelRunner


class InjectedFault(RuntimeError):
    pass


class FaultyWorker(OffloadWorker):
    def __init__(self, ctx, pp_rank: int) -> None:
        super().__init__(ctx, pp_rank)
        o = ctx.extra
        self.fail_at: str | None = o.get("fail_at") if o.get("fail_pp_rank", 0) == pp_rank else None
        self.fail_on_save = int(o.get("fail_on_save", 1))
        self.fail_on_step = o.get("fail_on_step")
        self.fail_on_load = bool(o.get("fail_on_load", False))
        is_faulty_stage = o.get("fault_pp_rank") in (None, pp_rank)
        self.save_fault = o.get("save_fault") if is_faulty_stage else None
        self.load_fault = o.get("load_fault") if is_faulty_stage else None
        self.hang_s = float(o.get("hang_s", 5.0))
        self.fault_after = int(o.get("fault_after", 0))
        self.fault_rate = float(o.get("fault_rate", 1.0))
        self.rng = random.Random(int(o.get("seed", 0)) * 100 + pp_rank)
        self.num_save_steps = self.num_steps = self.num_save_jobs = self.num_load_jobs = self.num_faults = 0
        self.armed: str | None = None  # where the step now running fails
        self.num_loads_started: dict[str, int] = {}  # request -> start_load_kv calls that started it

    def arm(self, plan) -> None:
        """Called once per step, as it is prepared: decides whether this step fails, and where."""
        self.armed = None
        if self.fail_at is None or plan.is_empty:
            return
        self.num_steps += 1
        meta = plan.kv_connector_metadata
        if meta is not None and meta.saves:
            self.num_save_steps += 1
        if self.fail_on_load:
            hit = meta is not None and bool(meta.loads)
            self.fail_on_load = not hit  # once
        elif self.fail_on_step is not None:
            hit = self.num_steps == int(self.fail_on_step)
        else:
            hit = meta is not None and bool(meta.saves) and self.num_save_steps == self.fail_on_save
        if hit:
            self.armed = self.fail_at

    def fire(self, where: str, step_id: int) -> None:
        if self.armed == where:
            self.armed = None
            raise InjectedFault(f"injected fault: {where} of step {step_id} on stage {self.pp_rank}")

    def start_load_kv(self, step_id: int) -> None:
        for load in self.metadata.loads:
            self.num_loads_started[load.request_id] = self.num_loads_started.get(load.request_id, 0) + 1
        self.fire("load_start", step_id)
        super().start_load_kv(step_id)

    def save_kv(self, step_id: int) -> None:
        self.fire("save_kv", step_id)
        super().save_kv(step_id)

    def _save(self, job, ready):
        self.num_save_jobs += 1
        self._job_fault(self.save_fault, self.num_save_jobs, "save", job)
        return super()._save(job, ready)

    def _load(self, job):
        self.num_load_jobs += 1
        self._job_fault(self.load_fault, self.num_load_jobs, "load", job)
        return super()._load(job)

    def _job_fault(self, fault: str | None, num_jobs: int, kind: str, job) -> None:
        if fault is None or num_jobs <= self.fault_after or self.rng.random() >= self.fault_rate:
            return
        self.num_faults += 1
        if self.rng.choice(fault.split("|")) == "raise":
            raise OSError(f"injected fault: {kind} of {job.transfer.request_id} on stage {self.pp_rank}")
        time.sleep(self.hang_s)  # a stuck store: the job has not touched the cache yet


def _worker_of(runner: ModelRunner) -> FaultyWorker | None:
    connector = runner.kv_connector.connector
    return connector if isinstance(connector, FaultyWorker) else None


_prepare_step = ModelRunner.prepare_step
_execute_model = ModelRunner.execute_model
_sample = ModelRunner._sample
_propose_drafts = ModelRunner.propose_drafts


def _faulty_prepare_step(self: ModelRunner, plan) -> None:
    """Every step is prepared once (ahead, or by its execute_model): arm the fault there, before the
    connector's binding starts its loads."""
    worker = _worker_of(self)
    if worker is not None:
        worker.arm(plan)
    return _prepare_step(self, plan)


def _faulty_execute_model(self: ModelRunner, plan, intermediate=None):
    if self.prepared is None or self.prepared[0] != plan.step_id:
        self.prepare_step(plan)  # armed now, unless a stage prepared (and armed) ahead
    worker = _worker_of(self)
    if worker is None or worker.armed != "forward":
        return _execute_model(self, plan, intermediate)

    def broken_forward(*args, **kwargs):
        worker.fire("forward", plan.step_id)

    self.model.forward = broken_forward  # an instance attribute: nn.Module.__call__ uses it
    try:
        return _execute_model(self, plan, intermediate)
    finally:
        del self.model.forward


def _faulty_sample(self: ModelRunner, state):
    worker = _worker_of(self)
    if worker is not None:
        worker.fire("sample", state.step_id)
    return _sample(self, state)


def _faulty_propose_drafts(self: ModelRunner, state, output) -> None:
    worker = _worker_of(self)
    if worker is not None:
        worker.fire("propose", state.step_id)
    return _propose_drafts(self, state, output)


ModelRunner.prepare_step = _faulty_prepare_step
ModelRunner.execute_model = _faulty_execute_model
ModelRunner._sample = _faulty_sample
ModelRunner.propose_drafts = _faulty_propose_drafts


class StuckScheduler(KVConnectorScheduler):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.load_blocks = int(ctx.extra.get("load_blocks", 0))
        self.ask_again_token = ctx.extra.get("ask_again_token")
        self.unsent: list[BlockTransfer] = []
        self.num_asked_again = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.ask_again_token is not None and request.prompt_token_ids[0] == self.ask_again_token:
            self.num_asked_again += 1  # a counter for the test: it changes nothing the engine sees
            return None, False
        bs = self.ctx.block_size
        num_blocks = min(self.load_blocks, (request.num_tokens - 1) // bs - num_computed_tokens // bs)
        return (num_blocks * bs, True) if num_blocks > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens:
            first = request.num_computed_tokens // self.ctx.block_size
            ids = block_ids[first : first + num_external_tokens // self.ctx.block_size]
            self.unsent.append(BlockTransfer(request.request_id, ids, [b"s" * 32] * len(ids)))

    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        loads, self.unsent = self.unsent, []
        return KVConnectorMetadata(loads=loads)

    def has_unsent_metadata(self) -> bool:
        return bool(self.unsent)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return bool(block_ids), None


class StuckWorker(KVConnectorWorker):
    def __init__(self, ctx, pp_rank: int) -> None:
        super().__init__(ctx, pp_rank)
        self.aborted: list[str] = []

    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        pass

    def abort_transfers(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset(), frozenset()


register_connector("faulty", OffloadScheduler, FaultyWorker)
register_connector("stuck", StuckScheduler, StuckWorker)
