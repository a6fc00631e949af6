"""`KVConnectorWrapper`: when a stage calls its KV connector, in one place (seed 003).

* `pre_forward(plan)`: let preempted requests' transfers finish before their
  blocks are reused, bind the plan's metadata, start its loads.
* `post_forward(finished_req_ids)`: start this step's saves, wait for those
  that must finish within it, collect what finished, and always clear the
  metadata. The last stage calls it at the very end of `sample_tokens`, after
  sampling and after the speculative proposer; the others at the end of
  their step. The state carried from `execute_model` to there holds only
  `finished_req_ids`, never a connector output.
* `no_forward(plan)`: both, for a step with no tokens for this stage, so
  transfers are still polled while the engine has nothing else to run.
Without a connector every call is a no-op returning None.
"""

from __future__ import annotations

import torch

from asyncpp.core.plan import StepPlan
from asyncpp.kv_transfer.base import KVConnectorWorker, collect_output
from asyncpp.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput

_NO_TRANSFERS = KVConnectorMetadata()


class KVConnectorWrapper:
    def __init__(self, connector: KVConnectorWorker | None = None) -> None:
        self.connector = connector
        self._step_id = -1

    @property
    def is_active(self) -> bool:
        return self.connector is not None

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], start_layer: int) -> None:
        if self.connector is not None:
            self.connector.register_kv_caches({start_layer + i: kv for i, kv in enumerate(kv_caches)})

    def pre_forward(self, plan: StepPlan) -> None:
        connector = self.connector
        if connector is None:
            return
        if plan.preempted_req_ids:
            connector.handle_preemptions(plan.preempted_req_ids)
        self._step_id = plan.step_id
        connector.bind_connector_metadata(plan.kv_connector_metadata or _NO_TRANSFERS)
        connector.start_load_kv(plan.step_id)

    def post_forward(self, finished_req_ids: frozenset[str], wait_for_save: bool = True) -> KVConnectorOutput | None:
        """`wait_for_save=False` when no forward ran (or it failed): nothing this step wrote may be saved."""
        connector = self.connector
        if connector is None:
            return None
        try:
            if wait_for_save and connector.has_metadata:
                connector.save_kv(self._step_id)
                connector.wait_for_save()
            return collect_output(connector, finished_req_ids)
        finally:
            connector.clear_connector_metadata()

    def no_forward(self, plan: StepPlan) -> KVConnectorOutput | None:
        self.pre_forward(plan)
        return self.post_forward(frozenset(plan.finished_req_ids), wait_for_save=False)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
