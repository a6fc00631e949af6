"""`KVConnectorWrapper`: when a stage calls its KV connector, in one place (seed 003).

* `pre_forward(plan)`: bind the plan's metadata, stop the transfers the
  engine aborted (past their deadline), let preempted requests' transfers
  finish before their blocks are reused, start the plan's loads.
* `post_forward(finished_req_ids)`: start this step's saves, wait for those
  that must finish within it, collect what finished, and always clear the
  metadata. The last stage calls it at the very end of `sample_tokens`, after
  sampling and after the speculative proposer; the others at the end of
  their step. The state carried from `execute_model` to there holds only
  `finished_req_ids`, never a connector output.
* `no_forward(plan)`: both, for a step with no tokens for this stage, so
  transfers are still polled while the engine has nothing else to run.
* `abort_step(plan, is_forward_done)`: close a step that failed anywhere on
  this stage: bind it if that never happened (its loads must still start, or
  be reported failed), save only what a finished forward wrote, collect.
* `get_handshake_metadata()`: this stage's transfer endpoint, once the KV
  caches are registered (the runner registers them when it is built).
Every report goes through a `TransferLedger`: the engine gets exactly one
report per owed transfer on every path, failures included.
Without a connector every call is a no-op returning None.
"""

from __future__ import annotations

import torch

from asyncpp.core.plan import StepPlan
from asyncpp.kv_transfer.base import KVConnectorWorker, collect_output
from asyncpp.kv_transfer.handshake import KVHandshakeMetadata
from asyncpp.kv_transfer.ledger import TransferLedger
from asyncpp.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput
from asyncpp.logging import get_logger

_NO_TRANSFERS = KVConnectorMetadata()


class KVConnectorWrapper:
    def __init__(self, connector: KVConnectorWorker | None = None) -> None:
        self.connector = connector
        self.ledger = TransferLedger()
        self.bound_step_id = -1  # the latest step whose metadata was bound (pre_forward)
        self.is_registered = False  # register_kv_caches ran: the handshake may be asked for
        self.log = get_logger(role="kv_connector", pp_rank=connector.pp_rank if connector is not None else None)

    @property
    def is_active(self) -> bool:
        return self.connector is not None

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], start_layer: int) -> None:
        if self.connector is not None:
            self.connector.register_kv_caches({start_layer + i: kv for i, kv in enumerate(kv_caches)})
        self.is_registered = True

    def get_handshake_metadata(self) -> KVHandshakeMetadata | None:
        """This stage's transfer endpoint (None: no connector, or it publishes none)."""
        if self.connector is None:
            return None
        if not self.is_registered:  # the endpoint describes the registered caches
            raise RuntimeError("get_handshake_metadata before register_kv_caches")
        return self.connector.get_handshake_metadata()

    def pre_forward(self, plan: StepPlan) -> None:
        connector = self.connector
        if connector is None:
            return
        metadata = plan.kv_connector_metadata or _NO_TRANSFERS
        self.bound_step_id = plan.step_id
        self.ledger.bind(metadata)
        connector.bind_connector_metadata(metadata)
        if metadata.aborted_req_ids:
            self._abort(metadata.aborted_req_ids, plan.step_id, "engine")  # past its deadline, or a handout withdrawn
        try:
            if plan.preempted_req_ids:
                connector.handle_preemptions(plan.preempted_req_ids)
            connector.start_load_kv(plan.step_id)
        except Exception:
            # The step fails. Nothing may write blocks a preempted request's save may still read,
            # and loads that may not have started are ended now, as failed.
            self._abort([*plan.preempted_req_ids, *(load.request_id for load in metadata.loads)], plan.step_id, "error")
            raise

    def post_forward(self, finished_req_ids: frozenset[str], wait_for_save: bool = True) -> KVConnectorOutput | None:
        """`wait_for_save=False` when no forward ran (or it failed): nothing this step wrote may be saved."""
        connector = self.connector
        if connector is None:
            return None
        try:
            if connector.has_metadata:
                saver_ids = [save.request_id for save in connector.metadata.saves]
                if not wait_for_save:
                    self.ledger.fail_saves(saver_ids)
                else:
                    try:
                        connector.save_kv(self.bound_step_id)
                        connector.wait_for_save()
                    except Exception:
                        self._abort(saver_ids, self.bound_step_id, "error")
                        raise
            try:
                output = collect_output(connector, finished_req_ids)
            except Exception as e:  # noqa: BLE001 - what it owes is ended by the engine's deadlines
                self.log.error("kv_collect_failed", step_id=self.bound_step_id, error=repr(e))
                output = None
            return self.ledger.settle(output, finished_req_ids)
        finally:
            connector.clear_connector_metadata()

    def no_forward(self, plan: StepPlan) -> KVConnectorOutput | None:
        self.pre_forward(plan)
        return self.post_forward(frozenset(plan.finished_req_ids), wait_for_save=False)

    def abort_step(self, plan: StepPlan, is_forward_done: bool) -> KVConnectorOutput | None:
        """A step that failed on this stage, before, in or after its forward: end it with one report."""
        if self.connector is None:
            return None
        finished = frozenset(plan.finished_req_ids)
        if self.bound_step_id != plan.step_id:  # failed before pre_forward: bind, start loads
            try:
                self.pre_forward(plan)
            except Exception as e:  # noqa: BLE001 - its loads are ended (failed) already; report them
                self.log.error("kv_connector_failed", step_id=plan.step_id, error=repr(e))
            is_forward_done = False
        # Metadata is still bound unless post_forward ran (and failed) already: then only collect.
        return self.post_forward(finished, wait_for_save=is_forward_done)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()

    def _abort(self, request_ids: list[str], step_id: int, reason: str) -> None:
        """Stop these requests' transfers here; the ones owed are reported as failed."""
        try:
            self.connector.abort_transfers(request_ids)
        except Exception as e:  # noqa: BLE001 - the connector broke its contract: report anyway, loudly
            self.log.error("kv_abort_failed", step_id=step_id, request_ids=request_ids, error=repr(e))
        for request_id in request_ids:
            what = [kind for kind, owed in (("load", self.ledger.owes_load), ("send", self.ledger.owes_send)) if owed(request_id)]
            if what:
                self.log.warning("kv_transfer_aborted", step_id=step_id, request_id=request_id, what=what, reason=reason)
        self.ledger.end_loads(request_ids)
        self.ledger.end_sends(request_ids)
        self.ledger.fail_saves(request_ids)
