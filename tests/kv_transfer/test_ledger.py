"""The stage's side of the rule: `TransferLedger` and `KVConnectorWrapper` report each owed transfer
exactly once, on every path (a scripted connector, no model)."""

from __future__ import annotations

import pytest
import torch

from asyncpp.core.plan import StepPlan
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorWorker
from asyncpp.kv_transfer.ledger import TransferLedger
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVConnectorOutput
from asyncpp.worker.kv_connector import KVConnectorWrapper

CTX = ConnectorContext("scripted", 2, ((0, 2), (2, 4)), 16, 2, 8, "float32", "m", "r")


def load(request_id: str, *block_ids: int) -> BlockTransfer:
    return BlockTransfer(request_id, list(block_ids), [bytes(32)] * len(block_ids))


def plan(step_id: int, *, preempted=(), finished=(), **metadata) -> StepPlan:
    return StepPlan(
        step_id, [], finished_req_ids=list(finished), preempted_req_ids=list(preempted),
        kv_connector_metadata=KVConnectorMetadata(**metadata),
    )  # fmt: skip


class Scripted(KVConnectorWorker):
    """Reports what the test tells it to; can raise from any call."""

    def __init__(self) -> None:
        super().__init__(CTX, 0)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.invalid: set[int] = set()
        self.raise_in: set[str] = set()
        self.calls: list[str] = []
        self.aborted: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.raise_in:
            raise RuntimeError(f"scripted {name} failure")

    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        pass

    def handle_preemptions(self, preempted_req_ids: list[str]) -> None:
        self._call("handle_preemptions")

    def start_load_kv(self, step_id: int) -> None:
        self._call("start_load_kv")

    def save_kv(self, step_id: int) -> None:
        self._call("save_kv")

    def abort_transfers(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def get_finished(self, finished_req_ids):
        self._call("get_finished")
        sending, recving, self.sending, self.recving = self.sending, self.recving, set(), set()
        return frozenset(sending), frozenset(recving)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        invalid, self.invalid = self.invalid, set()
        return frozenset(invalid)


def test_the_ledger_passes_owed_reports_once_and_drops_the_rest():
    ledger = TransferLedger()
    ledger.bind(KVConnectorMetadata(loads=[load("a", 1, 2)], held_req_ids=["b"]))
    got = ledger.settle(KVConnectorOutput(frozenset({"b", "x"}), frozenset({"a", "y"}), frozenset({2, 9})), frozenset({"b"}))
    assert got.finished_sending == {"b"} and got.finished_recving == {"a"} and got.invalid_block_ids == {2}
    assert ledger.num_owed == 0
    again = ledger.settle(KVConnectorOutput(frozenset({"b"}), frozenset({"a"})), frozenset())
    assert again.is_empty  # duplicates of transfers already reported


def test_skipped_saves_fail_the_send_when_it_is_reported():
    ledger = TransferLedger()
    ledger.fail_saves(["a", "c"])
    ledger.bind(KVConnectorMetadata(held_req_ids=["a"]))
    got = ledger.settle(KVConnectorOutput(finished_sending=frozenset({"a"})), frozenset({"a", "c"}))
    assert got.failed_sending == {"a"}
    # "c" finished without being held: nothing will ask about it again.
    ledger.bind(KVConnectorMetadata(held_req_ids=["c"]))
    assert not ledger.settle(KVConnectorOutput(finished_sending=frozenset({"c"})), frozenset()).failed_sending


def test_an_aborted_load_and_send_are_reported_failed_by_the_wrapper():
    worker = Scripted()
    wrapper = KVConnectorWrapper(worker)
    wrapper.pre_forward(plan(0, loads=[load("a", 4, 5)]))
    wrapper.post_forward(frozenset())
    wrapper.pre_forward(plan(1, finished=["b"], held_req_ids=["b"]))
    wrapper.post_forward(frozenset({"b"}))
    assert wrapper.ledger.num_owed == 2
    wrapper.pre_forward(plan(2, aborted_req_ids=["a", "b"]))
    worker.recving, worker.sending = {"a"}, {"b"}  # late reports after the abort: dropped
    got = wrapper.post_forward(frozenset())
    assert worker.aborted == ["a", "b"]
    assert got.finished_recving == {"a"} and got.invalid_block_ids == {4, 5}  # recomputed
    assert got.finished_sending == {"b"} and got.failed_sending == {"b"}
    assert wrapper.ledger.num_owed == 0


@pytest.mark.parametrize("failing", ["handle_preemptions", "start_load_kv"])
def test_loads_of_a_step_whose_pre_forward_fails_are_reported_failed_in_that_step(failing):
    worker = Scripted()
    worker.raise_in.add(failing)
    wrapper = KVConnectorWrapper(worker)
    step = plan(0, preempted=["p"], loads=[load("a", 7)])
    with pytest.raises(RuntimeError):
        wrapper.pre_forward(step)
    got = wrapper.abort_step(step, is_forward_done=False)
    assert got.finished_recving == {"a"} and got.invalid_block_ids == {7}
    assert set(worker.aborted) == {"a", "p"}  # nothing of theirs may touch the cache now
    assert worker.calls.count("start_load_kv") <= 1  # never started twice
    assert not worker.has_metadata


def test_a_step_that_fails_before_binding_is_bound_once_and_saves_nothing():
    worker = Scripted()
    wrapper = KVConnectorWrapper(worker)
    step = plan(3, loads=[load("a", 1)], saves=[load("s", 2)])
    wrapper.abort_step(step, is_forward_done=True)  # never bound: its forward cannot have run
    assert worker.calls == ["start_load_kv", "get_finished"]
    assert wrapper.ledger.owes_load("a")  # started: reported when the connector says so
    wrapper.pre_forward(plan(4, finished=["s"], held_req_ids=["s"]))
    worker.sending = {"s"}
    got = wrapper.post_forward(frozenset({"s"}))
    assert got.failed_sending == {"s"}  # its save of step 3 never ran


def test_a_step_that_failed_after_its_forward_still_saves():
    worker = Scripted()
    wrapper = KVConnectorWrapper(worker)
    step = plan(5, saves=[load("s", 2)])
    wrapper.pre_forward(step)
    wrapper.abort_step(step, is_forward_done=True)  # e.g. sampling failed on the last stage
    assert worker.calls == ["start_load_kv", "save_kv", "get_finished"]


def test_a_save_kv_that_raises_aborts_its_saves_and_later_collection_still_reports():
    worker = Scripted()
    worker.raise_in.add("save_kv")
    wrapper = KVConnectorWrapper(worker)
    step = plan(6, loads=[load("a", 3)], saves=[load("s", 2)])
    wrapper.pre_forward(step)
    with pytest.raises(RuntimeError):
        wrapper.post_forward(frozenset())
    assert worker.aborted == ["s"] and not worker.has_metadata
    worker.recving = {"a"}
    got = wrapper.abort_step(step, is_forward_done=True)  # the stage's error path: only collects
    assert got.finished_recving == {"a"} and worker.calls.count("save_kv") == 1
