"""The scheduler's KV-connector half (`core/scheduler_kv.py`), pure: a scripted connector, a fake clock.

Loads and sends end only when every stage reported them, each one has a
deadline after which every stage is told to abort it, blocks are freed once
no transfer holds them, "ask again later" holds up nobody else, and a failed
step's KV leaves the prefix cache.
"""

from __future__ import annotations

import pytest
from sched_helpers import make_request

from asyncpp.core.request import RequestStatus
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorScheduler, PlanInfo
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVConnectorOutput

BLOCK = 4
PP = 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Connector(KVConnectorScheduler):
    """Offers `offer_blocks` blocks to every request, holds finished ones when `hold`, and asks to be
    asked again for the ids in `ask_again`."""

    def __init__(self, offer_blocks: int = 0, hold: bool = False, ask_again=()) -> None:
        super().__init__(ConnectorContext("scripted", PP, ((0, 1), (1, 2)), BLOCK, 1, 4, "float32", "m", "r",
                                          load_timeout_s=5.0, save_timeout_s=7.0))
        self.offer_blocks, self.hold, self.ask_again = offer_blocks, hold, set(ask_again)
        self.offer_to_preempted_only = False
        self.offer_tokens: int | None = None  # offer this many tokens instead of whole blocks
        self.is_async = True  # False: loads within the plan (offered synchronously)
        self.unsent: list[BlockTransfer] = []
        self.outputs: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self.ask_again:
            return None, False
        if self.offer_to_preempted_only and not request.num_preemptions:
            return 0, False
        if self.offer_tokens is not None:
            return self.offer_tokens - num_computed_tokens, self.is_async
        num_blocks = min(self.offer_blocks, (request.num_tokens - 1) // BLOCK - num_computed_tokens // BLOCK)
        return (num_blocks * BLOCK, self.is_async) if num_blocks > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            first = request.num_computed_tokens // BLOCK
            blocks = block_ids[first : -(-(request.num_computed_tokens + num_external_tokens) // BLOCK)]
            self.unsent.append(BlockTransfer(request.request_id, blocks, [], is_sync=not self.is_async))

    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        loads, self.unsent = self.unsent, []
        return KVConnectorMetadata(loads=loads)

    def has_unsent_metadata(self) -> bool:
        return bool(self.unsent)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.outputs.append(output)

    def request_finished(self, request, block_ids):
        return self.hold, None


def scheduler(connector: Connector, clock: Clock, num_blocks: int = 16, prefix_caching: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=num_blocks * BLOCK,
        connector=connector, clock=clock,
    )  # fmt: skip


def report(s: Scheduler, plan, sampled=None, **per_stage) -> None:
    """Every stage's output for `plan`: keyword `stageK=KVConnectorOutput`."""
    outputs = [per_stage.get(f"stage{k}") for k in range(PP)]
    s.update_from_output(plan, sampled or {}, s.merge_kv_outputs(outputs))


def recv(*ids, invalid=()) -> KVConnectorOutput:
    return KVConnectorOutput(finished_recving=frozenset(ids), invalid_block_ids=frozenset(invalid))


def sent(*ids, failed=()) -> KVConnectorOutput:
    return KVConnectorOutput(finished_sending=frozenset(ids), failed_sending=frozenset(failed))


def test_a_load_past_its_deadline_is_aborted_and_recomputed():
    clock, connector = Clock(), Connector(offer_blocks=2)
    s = scheduler(connector, clock)
    s.add_request(make_request("a", list(range(1, 11))))
    plan = s.schedule(allow_empty=True)
    assert plan.kv_connector_metadata.loads[0].request_id == "a" and s.num_waiting_for_remote_kvs == 1
    report(s, plan, stage0=recv("a"))  # stage 1 never reports
    clock.now = 4.9
    plan = s.schedule(allow_empty=True)
    assert plan.kv_connector_metadata.aborted_req_ids == []
    report(s, plan)
    clock.now = 5.0
    plan = s.schedule(allow_empty=True)
    assert plan.kv_connector_metadata.aborted_req_ids == ["a"] and s.num_timed_out_transfers == 1
    report(s, plan, stage1=recv("a"))  # its wrapper ends it; stage 0's report counted already
    assert s.num_waiting_for_remote_kvs == 0 and s.num_partly_reported_transfers == 0
    assert s.stats().num_failed_load_tokens == 2 * BLOCK  # every loaded block is recomputed
    plan = s.schedule()
    assert plan.scheduled[0].start_position == 0 and plan.scheduled[0].num_tokens == 10
    assert not s.has_pending_transfers()


def test_a_send_past_its_deadline_fails_and_frees_the_blocks():
    clock, connector = Clock(), Connector(hold=True)
    s = scheduler(connector, clock)
    s.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=1))
    plan = s.schedule()
    report(s, plan, {"a": [9]})
    assert s.num_held_for_transfer == 1
    plan = s.schedule(allow_empty=True)
    assert plan.kv_connector_metadata.held_req_ids == ["a"] and plan.finished_req_ids == ["a"]
    report(s, plan, stage1=sent("a"))
    clock.now = 7.0
    plan = s.schedule(allow_empty=True)
    assert plan.kv_connector_metadata.aborted_req_ids == ["a"]
    assert s._block_manager.num_free_blocks < 16  # held until every stage has reported
    report(s, plan, stage0=sent("a", failed={"a"}))
    assert connector.outputs[-1].failed_sending == {"a"}  # the connector drops what it wrote
    assert s.num_held_for_transfer == 0 and s._block_manager.num_free_blocks == 16
    assert s.get_request("a") is None and not s.has_pending_transfers()


def test_a_request_finished_while_loading_and_held_keeps_its_blocks_until_both_end():
    clock, connector = Clock(), Connector(offer_blocks=1, hold=True)
    connector.offer_to_preempted_only = True
    s = scheduler(connector, clock, num_blocks=6, prefix_caching=False)  # what it computed is gone
    s.add_request(make_request("old", list(range(1, 9)), max_tokens=12, ignore_eos=True))
    s.add_request(make_request("a", list(range(20, 28)), max_tokens=12, ignore_eos=True))
    for _ in range(100):  # "old" grows until it takes a's blocks; "a" comes back through a load
        if s.num_waiting_for_remote_kvs:
            break
        plan = s.schedule(allow_empty=True)
        report(s, plan, {r.request_id: [5] for r in plan.scheduled if r.do_sample})
    assert s.get_request("a").status is RequestStatus.WAITING_FOR_REMOTE_KVS
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    plan = s.schedule(allow_empty=True)
    assert plan.kv_connector_metadata.held_req_ids == ["a"]  # its saves may still read its blocks
    report(s, plan, stage0=recv("a"), stage1=recv("a"))
    assert s._block_manager.has_blocks("a")  # the load ended, the send did not
    report(s, s.schedule(allow_empty=True), stage0=sent("a"), stage1=sent("a"))
    assert not s._block_manager.has_blocks("a") and s.get_request("a") is None


def test_ask_again_later_skips_the_request_for_others_until_its_deadline():
    clock, connector = Clock(), Connector(ask_again={"a"})
    s = scheduler(connector, clock)
    for name in "abc":
        s.add_request(make_request(name, [1, 2, 3]))
    plan = s.schedule()
    assert [r.request_id for r in plan.scheduled] == ["b", "c"]  # "a" keeps its place, waiting
    assert s.num_waiting == 1
    report(s, plan, {"b": [7], "c": [7]})
    clock.now = 5.0
    plan = s.schedule()
    assert "a" in [r.request_id for r in plan.scheduled]  # asked too long: computed instead


def test_a_report_for_a_request_nobody_waits_for_is_ignored():
    clock, connector = Clock(), Connector(offer_blocks=1)
    s = scheduler(connector, clock)
    s.add_request(make_request("a", list(range(1, 11))))
    plan = s.schedule(allow_empty=True)
    report(s, plan, stage0=recv("a", "ghost"), stage1=sent("ghost"))
    assert s.num_partly_reported_transfers == 1  # only "a", from stage 0
    report(s, s.schedule(allow_empty=True), stage1=recv("a"))
    assert s.num_partly_reported_transfers == 0 and connector.outputs[-1].finished_recving == {"a"}


def test_a_failed_step_uncaches_its_blocks_and_fails_requests_that_hit_them():
    clock, connector = Clock(), Connector()
    s = scheduler(connector, clock)
    prompt = list(range(1, 10))  # two full blocks
    s.add_request(make_request("a", prompt))
    first = s.schedule()
    s.add_request(make_request("b", prompt + [50]))
    second = s.schedule()  # "b" hits a's blocks, registered when "a" was scheduled
    assert second.scheduled[0].start_position == 2 * BLOCK
    report(s, first)  # no sampled token: the step failed
    assert s.discard_failed_step(first) == ["a", "b"]
    s.add_request(make_request("c", prompt))
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ERROR)
    report(s, second)
    plan = s.schedule()
    assert plan.scheduled[0].start_position == 0  # no hit on the failed step's blocks


def test_a_load_within_the_plan_is_computed_at_once():
    clock, connector = Clock(), Connector(offer_blocks=2)
    connector.is_async = False
    s = scheduler(connector, clock)
    s.add_request(make_request("a", list(range(1, 11))))
    plan = s.schedule()
    [load] = plan.kv_connector_metadata.loads
    assert load.is_sync and len(load.block_ids) == 2 and s.num_waiting_for_remote_kvs == 0
    # The same plan computes the tokens after the loaded ones.
    assert plan.scheduled[0].start_position == 2 * BLOCK and plan.scheduled[0].num_tokens == 2
    report(s, plan, {"a": [7]}, stage0=recv("a"), stage1=recv("a"))
    assert s.take_failed_requests() == []
    assert s.get_request("a").output_token_ids == [7] and s.stats().num_external_prefix_hit_tokens == 2 * BLOCK
    assert not s.has_pending_transfers()


def test_a_failed_load_within_the_plan_fails_its_request_and_whoever_hit_its_blocks():
    clock, connector = Clock(), Connector(offer_blocks=2)
    connector.is_async, connector.load_failure_policy = False, "fail"
    s = scheduler(connector, clock)
    s.add_request(make_request("a", list(range(1, 11)), max_tokens=4))
    plan = s.schedule()
    load = plan.kv_connector_metadata.loads[0]
    connector.offer_blocks = 0
    s.add_request(make_request("b", list(range(1, 11)), max_tokens=4))  # hits a's (not yet loaded) blocks
    plan_b = s.schedule()
    assert plan_b.scheduled[0].request_id == "b" and plan_b.scheduled[0].start_position == 2 * BLOCK
    report(s, plan, {"a": [7]}, stage0=recv("a"), stage1=recv("a", invalid={load.block_ids[1]}))
    failed = dict(s.take_failed_requests())
    assert set(failed) == {"a", "b"} and "failed to load 1 of the 2 blocks" in failed["a"]
    assert s.stats().num_failed_load_tokens == 2 * BLOCK and s.stats().num_external_prefix_hit_tokens == 0
    # The bad blocks left the prefix cache: a new request computes its prompt.
    for request_id in failed:
        s.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
    report(s, plan_b, {"b": [5]})
    s.add_request(make_request("c", list(range(1, 11))))
    plan_c = s.schedule()
    assert plan_c.scheduled[0].request_id == "c" and plan_c.scheduled[0].start_position == 0


def test_a_failed_load_within_the_plan_is_recomputed_from_scratch():
    clock, connector = Clock(), Connector(offer_blocks=2)
    connector.is_async = False  # the default policy: recompute
    s = scheduler(connector, clock)
    s.add_request(make_request("a", list(range(1, 11)), max_tokens=4))
    plan = s.schedule()
    load = plan.kv_connector_metadata.loads[0]
    connector.offer_blocks = 0
    report(s, plan, {"a": [7]}, stage0=recv("a", invalid={load.block_ids[0]}), stage1=recv("a"))
    assert s.take_failed_requests() == []
    request = s.get_request("a")
    assert request.output_token_ids == [] and request.status is RequestStatus.PREEMPTED  # 7 came from missing KV
    plan = s.schedule()
    assert plan.scheduled[0].start_position == 0 and plan.scheduled[0].num_tokens == 10  # all of it again
    assert plan.preempted_req_ids == ["a"] and s.stats().num_external_prefix_hit_tokens == 0


def test_a_send_past_its_deadline_is_failed_even_if_every_stage_then_reports_it_done():
    """Once the engine gave up on a send, what it wrote is untrusted: the merged report says failed
    whatever the stages say (the connector then drops those slots)."""
    clock, connector = Clock(), Connector(hold=True)
    s = scheduler(connector, clock)
    s.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=1))
    plan = s.schedule()
    report(s, plan, {"a": [9]})
    clock.now = 7.0
    plan = s.schedule(allow_empty=True)
    assert plan.kv_connector_metadata.aborted_req_ids == ["a"]
    report(s, plan, stage0=sent("a"), stage1=sent("a"))  # both say done, neither says failed
    assert connector.outputs[-1].finished_sending == {"a"} and connector.outputs[-1].failed_sending == {"a"}
    assert s.num_held_for_transfer == 0 and s._block_manager.num_free_blocks == 16


def remote_request(request_id: str, num_prompt_tokens: int, first_token: int = 42):
    """A request whose prompt a remote engine computed and whose first token it sampled (PD decode)."""
    request = make_request(request_id, list(range(1, num_prompt_tokens + 1)))
    request.output_token_ids = [first_token]
    return request


def test_a_load_of_the_whole_prompt_ends_in_a_partly_filled_block_and_computes_the_remote_token():
    for is_async in (True, False):
        clock, connector = Clock(), Connector()
        connector.offer_tokens, connector.is_async = 10, is_async  # 2 blocks of 4 and 2 tokens of a third
        s = scheduler(connector, clock)
        s.add_request(remote_request("a", 10))
        plan = s.schedule(allow_empty=True)
        [load] = plan.kv_connector_metadata.loads
        assert len(load.block_ids) == 3
        if is_async:
            assert plan.scheduled == [] and s.num_waiting_for_remote_kvs == 1
            report(s, plan, stage0=recv("a"), stage1=recv("a"))
            plan = s.schedule()
        # Only the remote engine's token is computed, at the position after the prompt.
        assert (plan.scheduled[0].start_position, plan.scheduled[0].num_tokens) == (10, 1), is_async
        report(s, plan, {"a": [7]}, stage0=recv("a"), stage1=recv("a"))
        assert s.get_request("a").output_token_ids == [42, 7]
        assert s.stats().num_external_prefix_hit_tokens == 10


def test_a_partly_filled_block_may_only_end_a_load_at_the_prompts_end():
    clock, connector = Clock(), Connector()
    connector.offer_tokens = 6  # a block and a half of a 10-token prompt
    s = scheduler(connector, clock)
    s.add_request(remote_request("a", 10))
    with pytest.raises(ValueError, match="whole blocks"):
        s.schedule(allow_empty=True)


def test_a_load_may_not_leave_nothing_to_compute():
    clock, connector = Clock(), Connector()
    connector.offer_tokens = 10  # the whole prompt, and no token after it
    s = scheduler(connector, clock)
    s.add_request(make_request("a", list(range(1, 11))))
    with pytest.raises(ValueError, match="at least one token to compute"):
        s.schedule(allow_empty=True)


def test_only_a_load_someone_waits_for_is_a_pending_load():
    """Held blocks (a finished request's sends) are pending transfers, but no request waits on them:
    the engine polls for those slowly (`step_window.HELD_POLL_INTERVAL_S`)."""
    clock, connector = Clock(), Connector(hold=True)
    s = scheduler(connector, clock)
    s.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=1))
    report(s, s.schedule(), {"a": [9]})
    assert s.num_held_for_transfer == 1
    plan = s.schedule(allow_empty=True)
    assert s.has_pending_transfers() and not s.has_pending_loads()
    connector.offer_blocks = 1
    s.add_request(make_request("b", list(range(1, 10))))
    s.schedule(allow_empty=True)
    assert s.num_waiting_for_remote_kvs == 1 and s.has_pending_loads()
    report(s, plan)
