"""`KVOutputAggregator`: a transfer ends once every stage reported it, counted by stage, once."""

from __future__ import annotations

from asyncpp.kv_transfer.aggregator import KVOutputAggregator
from asyncpp.kv_transfer.metadata import KVConnectorOutput, KVTransferStats


def out(sending=(), recving=(), failed=(), invalid=(), blocks_saved=0) -> KVConnectorOutput:
    return KVConnectorOutput(
        frozenset(sending), frozenset(recving), frozenset(invalid), KVTransferStats(num_blocks_saved=blocks_saved),
        frozenset(failed),
    )


def test_a_request_finishes_on_the_step_its_last_stage_reports_it():
    agg = KVOutputAggregator(3)
    assert agg.aggregate([out(recving={"a"}), None, out(recving={"a"})]).finished_recving == frozenset()
    assert agg.num_pending() == 1 and agg.reporters("a") == (frozenset(), frozenset({0, 2}))
    merged = agg.aggregate([None, out(recving={"a"}), None])
    assert merged.finished_recving == {"a"} and agg.num_pending() == 0  # and forgotten


def test_a_stage_reporting_twice_counts_once():
    agg = KVOutputAggregator(2)
    assert not agg.aggregate([out(sending={"a"}), None]).finished_sending
    assert not agg.aggregate([out(sending={"a"}), None]).finished_sending  # stage 0 again: still missing 1
    assert agg.aggregate([None, out(sending={"a"})]).finished_sending == {"a"}


def test_reports_nobody_waits_for_are_dropped_not_counted():
    agg = KVOutputAggregator(2)
    awaited = {"b"}
    merged = agg.aggregate([out(sending={"a", "b"}), out(sending={"a"})], awaited.__contains__)
    assert merged.finished_sending == frozenset() and agg.reporters("a") == (frozenset(), frozenset())
    # An id reused by a new request later is not finished early by the stale reports.
    assert not agg.aggregate([out(sending={"a"}), None]).finished_sending


def test_a_send_fails_if_any_stage_failed_it_and_forget_drops_partial_reports():
    agg = KVOutputAggregator(2)
    agg.aggregate([out(sending={"a"}, failed={"a"}), out(sending={"b"})])
    merged = agg.aggregate([out(sending={"b"}), out(sending={"a"})])
    assert merged.finished_sending == {"a", "b"} and merged.failed_sending == {"a"}
    agg.aggregate([out(sending={"c"}, failed={"c"}), None])
    agg.forget("c")
    assert agg.num_pending() == 0
    merged = agg.aggregate([out(sending={"c"}), out(sending={"c"})])  # a new request "c", all good
    assert merged.finished_sending == {"c"} and not merged.failed_sending


def test_invalid_blocks_and_stats_merge_as_they_come():
    agg = KVOutputAggregator(2)
    merged = agg.aggregate([out(invalid={3}, blocks_saved=2), out(invalid={4}, blocks_saved=5)])
    assert merged.invalid_block_ids == {3, 4} and merged.stats.num_blocks_saved == 7
