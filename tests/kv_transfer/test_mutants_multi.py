"""The multi connector's scheduler half, alone (no engine): only the child that offered a request's
external tokens is told to load them, and its loads reach the stages tagged with its index. Written
for mutation-test survivors in `kv_transfer/multi.py` and `kv_transfer/registry.py`."""

from __future__ import annotations

import pytest

import tests.kv_transfer.connectors  # noqa: F401  (registers the recording connector)
from asyncpp.kv_transfer.base import (
    ConnectorContext,
    KVConnectorScheduler,
    KVConnectorWorker,
    PlanInfo,
)
from asyncpp.kv_transfer.multi import MultiScheduler
from asyncpp.kv_transfer.registry import register_connector
from tests.core.sched_helpers import make_request

BLOCK = 16


def ctx(name: str, children: tuple[ConnectorContext, ...] = (), **extra) -> ConnectorContext:
    return ConnectorContext(
        name=name, pp_size=1, layer_ranges=((0, 4),), block_size=BLOCK, num_kv_heads=2, head_dim=8,
        dtype="float32", model_id="test", run_id="test", extra=extra, children=children,
    )  # fmt: skip


def multi_whose_second_child_offers(num_blocks: int = 2) -> MultiScheduler:
    return MultiScheduler(ctx("multi", (ctx("recording"), ctx("recording", load_blocks=num_blocks))))


def test_only_the_child_that_offered_is_told_to_load():
    multi = multi_whose_second_child_offers()
    request = make_request("r", list(range(3, 53)))  # 50 tokens: 3 full blocks before the last token
    assert multi.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
    multi.update_state_after_alloc(request, [7, 8, 9, 10], 2 * BLOCK)
    first, second = multi.children
    assert first.unsent == [] and first.offered == set()  # told "no external tokens"
    assert [t.block_ids for t in second.unsent] == [[7, 8]]


def test_no_child_loads_when_the_request_has_no_external_tokens():
    multi = multi_whose_second_child_offers()
    request = make_request("r", list(range(3, 53)))
    multi.update_state_after_alloc(request, [7, 8, 9, 10], 0)
    assert [child.unsent for child in multi.children] == [[], []]


def test_loads_carry_the_index_of_the_child_that_owns_them():
    multi = multi_whose_second_child_offers()
    request = make_request("r", list(range(3, 53)))
    multi.get_num_new_matched_tokens(request, 0)
    multi.update_state_after_alloc(request, [7, 8, 9, 10], 2 * BLOCK)
    meta = multi.build_connector_meta(PlanInfo(step_id=1, scheduled=[], block_ids={}, block_hashes={}))
    # Each stage hands a child only the transfers with its index: index 0 would give the load to
    # the child that never offered it, and the one that did would never start it.
    assert [(t.request_id, t.block_ids, t.connector_index) for t in meta.loads] == [("r", [7, 8], 1)]


def test_the_name_none_cannot_be_registered():
    with pytest.raises(ValueError, match="reserved"):
        register_connector("none", KVConnectorScheduler, KVConnectorWorker)


def test_a_restart_is_allowed_only_if_every_child_can_forget_and_each_is_told():
    multi = multi_whose_second_child_offers()
    assert not multi.can_forget_transfers  # the recording connector cannot
    first, second = multi.children
    told = []
    for child in multi.children:
        child.can_forget_transfers = True
        child.forget_transfers = lambda child=child: told.append(child)
    assert multi.can_forget_transfers
    multi._unsent_holders["r"] = [1]
    multi.forget_transfers()
    assert told == [first, second] and multi._unsent_holders == {}
    first.can_forget_transfers = False
    assert not multi.can_forget_transfers
    with pytest.raises(NotImplementedError, match="cannot go on after a stage restart"):
        KVConnectorScheduler.forget_transfers(first)
