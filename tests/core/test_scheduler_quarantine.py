"""Blocks a read the transport could not stop may still write: a stage reports them quarantined, the
engine keeps them out of the free pool (and the prefix cache) until that stage reports them released;
a request's blocks are never reused while a load within its plan may still write them."""

from __future__ import annotations

from sched_helpers import make_request
from test_scheduler_kv import BLOCK, Clock, Connector, report, scheduler

from asyncpp.core.request import RequestStatus
from asyncpp.kv_transfer.metadata import KVConnectorOutput


def stuck(*ids, blocks) -> KVConnectorOutput:
    """A stage whose load of `ids` failed and whose read into `blocks` could not be stopped."""
    return KVConnectorOutput(
        finished_recving=frozenset(ids), invalid_block_ids=frozenset(blocks), quarantined_block_ids=list(blocks)
    )


def test_a_request_aborted_during_its_load_within_a_plan_keeps_its_blocks_until_the_plan_is_back():
    clock, connector = Clock(), Connector(offer_blocks=2)
    connector.is_async = False
    s = scheduler(connector, clock, num_blocks=4, prefix_caching=False)
    s.add_request(make_request("a", list(range(1, 11))))  # 3 blocks, 2 of them loaded within the plan
    plan = s.schedule()
    [load] = plan.kv_connector_metadata.loads
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # while its plan (and its read) is in flight
    connector.offer_blocks = 0
    s.add_request(make_request("b", list(range(20, 30))))  # needs 3 blocks: only 1 is free
    assert s.schedule() is None
    # The plan is back: one stage could not stop its read. Those blocks stay out of the free pool.
    done = KVConnectorOutput(finished_recving=frozenset({"a"}))
    report(s, plan, stage0=stuck("a", blocks=load.block_ids), stage1=done)
    bm = s._block_manager
    assert s.num_quarantined_blocks == 2 and bm.num_free_blocks == 2
    assert s.schedule() is None  # b still does not fit
    report_release(s, load.block_ids)
    assert s.num_quarantined_blocks == 0 and bm.num_free_blocks == 4
    plan_b = s.schedule()
    assert plan_b.scheduled[0].request_id == "b"


def test_a_load_within_a_plan_that_failed_after_its_request_was_aborted_leaves_the_prefix_cache():
    clock, connector = Clock(), Connector(offer_blocks=2)
    connector.is_async = False
    s = scheduler(connector, clock, num_blocks=8)
    s.add_request(make_request("a", list(range(1, 11))))
    plan = s.schedule()
    [load] = plan.kv_connector_metadata.loads
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    failed = KVConnectorOutput(finished_recving=frozenset({"a"}), invalid_block_ids=frozenset(load.block_ids))
    report(s, plan, stage0=failed, stage1=KVConnectorOutput(finished_recving=frozenset({"a"})))
    assert s._block_manager.num_free_blocks == 8 and s.take_failed_requests() == []
    connector.offer_blocks = 0
    s.add_request(make_request("c", list(range(1, 11))))  # the same prompt: nothing of it is cached
    assert s.schedule().scheduled[0].start_position == 0


def test_an_async_load_whose_read_cannot_be_stopped_fails_instead_of_computing_into_its_blocks():
    clock, connector = Clock(), Connector(offer_blocks=2)
    s = scheduler(connector, clock, num_blocks=8)
    s.add_request(make_request("a", list(range(1, 11))))
    plan = s.schedule(allow_empty=True)
    [load] = plan.kv_connector_metadata.loads
    report(s, plan, stage0=stuck("a", blocks=load.block_ids[1:]), stage1=stuck("a", blocks=load.block_ids[1:]))
    [(request_id, why)] = s.take_failed_requests()
    assert request_id == "a" and "could not be stopped" in why
    s.finish_requests(["a"], RequestStatus.FINISHED_ERROR)
    bm = s._block_manager
    assert bm.ref_count(load.block_ids[1]) == 2  # one per stage's read
    assert bm.num_free_blocks == 8 - 1
    # A request with the same prompt does not hit the quarantined block: computed after the good one.
    connector.offer_blocks = 0
    s.add_request(make_request("c", list(range(1, 11))))
    assert s.schedule().scheduled[0].start_position <= BLOCK
    report_release(s, load.block_ids[1:], stages=2)
    assert s.num_quarantined_blocks == 0


def report_release(s, block_ids, stages: int = 1) -> None:
    """Idle plans carrying each stage's word that its reads into `block_ids` ended."""
    plan = s.schedule(allow_empty=True)
    released = KVConnectorOutput(released_block_ids=list(block_ids))
    s.update_from_output(plan, {}, s.merge_kv_outputs([released] * stages + [None] * (2 - stages)))
