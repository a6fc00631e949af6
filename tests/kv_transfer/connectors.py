"""Test connectors, registered on import (`kv_transfer.module = "tests.kv_transfer.connectors"`).

* `recording`: moves nothing; every worker call is recorded (in memory, and
  as JSON lines under `options.events_dir` when set, one file per stage, so
  a launched engine's stages can be checked too). With `options.load_blocks`
  > 0 every request with enough prompt is offered that many blocks as an async
  load that "fails" (every block reported invalid), so the engine must
  recompute them, and the loads finish on stage k only after
  `(k + 1) * options.delay_steps` polls: the stages report on different steps.
* `staggered`: the recording connector's loads, plus every finished request's
  blocks are held for a "send" that stage k reports `(k + 1) * delay_steps`
  polls after it learns the request finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from asyncpp.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, PlanInfo
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVConnectorOutput
from asyncpp.kv_transfer.registry import register_connector


class RecordingScheduler(KVConnectorScheduler):
    delays_send = False

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.load_blocks = int(ctx.extra.get("load_blocks", 0))
        self.unsent: list[BlockTransfer] = []
        self.offered: set[str] = set()
        self.plans: list[PlanInfo] = []
        self.outputs: list[KVConnectorOutput] = []  # every merged output, one per step
        self.finished_recving_at: dict[str, int] = {}  # request -> index into outputs
        self.finished_sending_at: dict[str, int] = {}
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.ctx.block_size
        if not self.load_blocks or request.request_id in self.offered:
            return 0, False
        num_blocks = min(self.load_blocks, (request.num_tokens - 1) // bs - num_computed_tokens // bs)
        return (num_blocks * bs, True) if num_blocks > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens:
            self.offered.add(request.request_id)
            first = request.num_computed_tokens // self.ctx.block_size
            ids = block_ids[first : first + num_external_tokens // self.ctx.block_size]
            self.unsent.append(BlockTransfer(request.request_id, ids, [b"x" * 32] * len(ids)))

    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        self.plans.append(plan)
        loads, self.unsent = self.unsent, []
        return KVConnectorMetadata(loads=loads)

    def has_unsent_metadata(self) -> bool:
        return bool(self.unsent)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_recving:
            self.finished_recving_at[request_id] = len(self.outputs)
        for request_id in output.finished_sending:
            self.finished_sending_at[request_id] = len(self.outputs)
        self.outputs.append(output)

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return self.delays_send and bool(block_ids), None

    def first_scheduled_at(self, request_id: str) -> int | None:
        return next((i for i, p in enumerate(self.plans) if any(r.request_id == request_id for r, _, _ in p.scheduled)), None)


class StaggeredScheduler(RecordingScheduler):
    delays_send = True


class RecordingWorker(KVConnectorWorker):
    def __init__(self, ctx, pp_rank: int) -> None:
        super().__init__(ctx, pp_rank)
        self.delay = (pp_rank + 1) * int(ctx.extra.get("delay_steps", 1))
        self.events: list[tuple[str, int, dict]] = []  # (event, step_id, fields)
        self.step_id = -1
        self.loads: dict[str, list] = {}  # request -> [polls left, block ids]
        self.sends: dict[str, int] = {}  # request -> polls left
        self.failed: set[int] = set()
        self.delays_send = ctx.name == "staggered"
        events_dir = ctx.extra.get("events_dir")
        self.events_file = Path(events_dir) / f"stage{pp_rank}-{os.getpid()}.jsonl" if events_dir else None

    def record(self, event: str, **fields: Any) -> None:
        self.events.append((event, self.step_id, fields))
        if self.events_file is not None:
            with self.events_file.open("a") as f:
                f.write(json.dumps({"event": event, "step_id": self.step_id, "pp_rank": self.pp_rank, **fields}) + "\n")

    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = sorted(kv_caches)
        self.record("register_kv_caches", layers=self.layers)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)  # recorded by start_load_kv, which learns the step id

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.record("clear")

    def handle_preemptions(self, preempted_req_ids: list[str]) -> None:
        self.record("handle_preemptions", req_ids=list(preempted_req_ids))

    def start_load_kv(self, step_id: int) -> None:
        self.step_id = step_id
        self.record("bind", num_loads=len(self.metadata.loads))
        self.record("start_load_kv")
        for load in self.metadata.loads:
            self.loads[load.request_id] = [self.delay, list(load.block_ids)]

    def save_kv(self, step_id: int) -> None:
        self.record("save_kv")

    def wait_for_save(self) -> None:
        self.record("wait_for_save")

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        self.record("get_finished", finished_req_ids=sorted(finished_req_ids))
        recving = set()
        for request_id, state in list(self.loads.items()):
            state[0] -= 1
            if state[0] <= 0:
                recving.add(request_id)
                self.failed.update(state[1])  # nothing was really loaded: the engine must recompute
                del self.loads[request_id]
        if self.delays_send:
            for request_id in finished_req_ids:
                self.sends[request_id] = self.delay
        sending = set()
        for request_id in list(self.sends):
            self.sends[request_id] -= 1
            if self.sends[request_id] <= 0:
                sending.add(request_id)
                del self.sends[request_id]
        if sending or recving:
            self.record("reported", sending=sorted(sending), recving=sorted(recving))
        return frozenset(sending), frozenset(recving)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        failed, self.failed = self.failed, set()
        return frozenset(failed)


register_connector("recording", RecordingScheduler, RecordingWorker)
register_connector("staggered", StaggeredScheduler, RecordingWorker)
