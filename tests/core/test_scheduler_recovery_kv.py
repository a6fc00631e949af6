"""`Scheduler.recompute_all` with a KV connector: the transfers that died with the stages are forgotten.

A scripted connector (`test_scheduler_kv.Connector`) loads, holds sends and
has a block quarantined when the stages are restarted: afterwards no block is
held, no transfer is pending, and the request that was loading is offered its
load again by the next plan.
"""

from __future__ import annotations

import types

import pytest
from sched_helpers import make_request
from test_scheduler_kv import Clock, Connector, recv, report, scheduler, sent

from asyncpp.core.request import RequestStatus
from asyncpp.kv_transfer.metadata import KVConnectorOutput


class ForgettingConnector(Connector):
    can_forget_transfers = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.num_forgotten = 0

    def forget_transfers(self) -> None:
        self.num_forgotten += 1
        self.unsent = []


def test_a_connector_that_cannot_forget_its_transfers_refuses_recompute_all():
    s = scheduler(Connector(), Clock())
    assert not s.can_recompute_all
    with pytest.raises(RuntimeError, match="KV connector"):
        s.recompute_all()
    s.connector = types.SimpleNamespace(can_forget_transfers=True)
    assert s.can_recompute_all


def test_loads_sends_and_quarantines_in_flight_are_forgotten_and_the_load_offered_again():
    clock, connector = Clock(), ForgettingConnector(offer_blocks=2, hold=True)
    s = scheduler(connector, clock, num_blocks=32)
    s.add_request(make_request("held", [40, 41, 42, 43, 44], max_tokens=1))
    connector.offer_blocks = 0
    plan = s.schedule()
    report(s, plan, {"held": [9]})  # finished: its blocks are held for its sends
    connector.offer_blocks = 2
    s.add_request(make_request("loading", list(range(1, 11)), max_tokens=4))
    s.add_request(make_request("running", list(range(60, 66)), max_tokens=4))
    connector.ask_again.add("running")
    plan = s.schedule(allow_empty=True)
    assert [t.request_id for t in plan.kv_connector_metadata.loads] == ["loading"]
    assert plan.kv_connector_metadata.held_req_ids == ["held"]
    loading_blocks = plan.kv_connector_metadata.loads[0].block_ids
    report(s, plan, stage0=KVConnectorOutput(
        finished_recving=frozenset({"loading"}), quarantined_block_ids=[loading_blocks[0]],
        finished_sending=frozenset({"held"}),
    ))  # fmt: skip  # stage 1 never reports: both transfers stay partly reported
    assert s.num_waiting_for_remote_kvs == 1 and s.num_held_for_transfer == 1
    assert s.num_quarantined_blocks == 1 and s.num_partly_reported_transfers == 2
    connector.ask_again.discard("running")
    connector.offer_blocks = 0
    plan = s.schedule()  # "running" starts; its plan is in flight at the restart
    assert [e.request_id for e in plan.scheduled] == ["running"]

    recompute = s.recompute_all()

    assert connector.num_forgotten == 1
    assert (recompute.num_requests, recompute.num_discarded_steps) == (2, 1)
    assert s.get_request("held") is None and s.num_held_for_transfer == 0
    loading = s.get_request("loading")
    assert loading.status is RequestStatus.PREEMPTED and loading.num_computed_tokens == 0
    assert s.num_waiting_for_remote_kvs == 0 and s.num_waiting == 2
    assert s.num_quarantined_blocks == 0 and s.num_partly_reported_transfers == 0
    assert s._block_manager.num_free_blocks == 32 and not s.has_pending_transfers()
    connector.offer_blocks = 2
    plan = s.schedule(allow_empty=True)
    meta = plan.kv_connector_metadata
    assert [t.request_id for t in meta.loads] == ["loading", "running"]  # from the store: the new stages load them
    assert meta.held_req_ids == [] and meta.aborted_req_ids == [] and plan.finished_req_ids == []
    report(s, plan, stage0=recv("loading", "running"), stage1=recv("loading", "running"))
    assert s.num_waiting_for_remote_kvs == 0
    assert s.get_request("loading").num_computed_tokens == 2 * 4 and s.get_request("running").num_computed_tokens == 4
    report(s, s.schedule(allow_empty=True), stage0=sent("held"), stage1=sent("held"))  # a late report of the dead: ignored
    assert s.get_request("held") is None
