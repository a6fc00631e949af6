"""The scheduler's side of speculative decoding, pure: drafts scheduled after a decode token, never in
the request's tokens, block hashes or a connector's view as known tokens; rollback and block trim over
rejected drafts; optimistic continuations under async scheduling and their voiding."""

from __future__ import annotations

from sched_helpers import make_request
from test_scheduler_kv import BLOCK, Clock, Connector

from asyncpp.core.plan import PLACEHOLDER_TOKEN_ID as PH
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager
from asyncpp.speculative.policy import DraftPolicy


class RecordingConnector(Connector):
    def __init__(self) -> None:
        super().__init__()
        self.plans = []

    def build_connector_meta(self, plan):
        self.plans.append(plan)
        return super().build_connector_meta(plan)


def spec_scheduler(k: int = 3, async_scheduling: bool = False, connector=None, num_blocks: int = 32) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BLOCK, enable_prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=num_blocks * BLOCK, async_scheduling=async_scheduling, connector=connector, clock=Clock(),
        draft_policy=DraftPolicy(k, adaptive=False),
    )  # fmt: skip


def prefill(s: Scheduler, prompt, drafts) -> None:
    s.add_request(make_request("a", prompt, max_tokens=50))
    plan = s.schedule()
    s.update_from_output(plan, {"a": [100]}, None, {"a": drafts})


def test_drafts_follow_the_decode_token_and_never_join_the_tokens():
    connector = RecordingConnector()
    s = spec_scheduler(connector=connector)
    prefill(s, [1, 2, 3, 4, 5, 6, 7], [101, 102, 103, 104])  # the proposer found 4: k = 3 are taken
    plan = s.schedule()
    (r,) = plan.scheduled
    assert (r.token_ids, r.start_position, r.num_draft_tokens, r.do_sample) == ([100, 101, 102, 103], 7, 3, True)
    request = s.get_request("a")
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 100]  # no draft in the tokens
    info = connector.plans[-1]
    assert info.num_draft_tokens == {"a": 3}
    assert len(info.block_hashes["a"]) == 2  # two full blocks of known tokens (8), none over drafts
    assert len(r.block_ids) == 3  # KV for positions 7..10


def test_rejected_drafts_roll_back_and_their_blocks_go():
    s = spec_scheduler()
    prefill(s, [1, 2, 3, 4, 5, 6, 7, 8], [101, 102, 103])
    plan = s.schedule()  # positions 8..11: the last token and three drafts, 3 blocks
    assert len(plan.scheduled[0].block_ids) == 3
    free_before = s._block_manager.num_free_blocks
    updates = s.update_from_output(plan, {"a": [101, 7]}, None, {"a": []})  # one draft accepted, then 7
    request = s.get_request("a")
    assert updates[0].new_token_ids == [101, 7]
    assert request.output_token_ids == [100, 101, 7]
    assert request.num_computed_tokens == 10  # up to the accepted draft; 7 is computed next
    assert len(s._block_manager.block_ids("a")) == 3  # position 10 is in block 2
    stats = s.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (1, 3, 1)
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]
    assert s._block_manager.num_free_blocks == free_before


def test_a_block_holding_only_rejected_drafts_is_freed():
    s = spec_scheduler()
    prefill(s, [1, 2, 3, 4, 5, 6], [101, 102, 103])
    plan = s.schedule()  # positions 6..9: block 2 (8..11) holds only drafts
    assert len(plan.scheduled[0].block_ids) == 3
    free_before = s._block_manager.num_free_blocks
    s.update_from_output(plan, {"a": [9]}, None, {"a": []})  # nothing accepted
    assert s.get_request("a").num_computed_tokens == 7
    assert len(s._block_manager.block_ids("a")) == 2  # 7 tokens and the next one's slot
    assert s._block_manager.num_free_blocks == free_before + 1
    plan = s.schedule()
    assert plan.scheduled[0].token_ids == [9] and plan.scheduled[0].start_position == 7


def test_max_tokens_caps_the_drafts():
    s = spec_scheduler(k=3)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    plan = s.schedule()
    s.update_from_output(plan, {"a": [100]}, None, {"a": [101, 102, 103]})
    plan = s.schedule()
    assert plan.scheduled[0].num_draft_tokens == 1  # one token made, one draft and a bonus reach 3
    updates = s.update_from_output(plan, {"a": [101, 5]}, None, {"a": [1]})
    assert updates[0].new_token_ids == [101, 5] and updates[0].finish_reason == "length"


def test_async_continuation_carries_placeholder_drafts_and_is_voided_by_a_rejection():
    s = spec_scheduler(k=2, async_scheduling=True)
    prefill(s, [1, 2, 3, 4, 5], [101, 102])
    first = s.schedule()  # [100, 101, 102] at 5..7
    assert first.scheduled[0].num_draft_tokens == 2
    cont = s.schedule(after_step_id=first.step_id)  # placed as if both drafts are accepted
    (r,) = cont.scheduled
    assert (r.token_ids, r.start_position, r.num_draft_tokens) == ([PH, PH, PH], 8, 2)
    assert cont.after_step_id == first.step_id
    # The first step rejects its second draft: the continuation is void.
    s.update_from_output(first, {"a": [101, 9]}, None, {"a": [50, 51]})
    request = s.get_request("a")
    assert request.num_computed_tokens == 7 and request.void_step_id == cont.step_id
    # It goes on at once from what was accepted, in a plan after the void one (whose rows it overwrites).
    plan = s.schedule(after_step_id=cont.step_id)
    assert (plan.scheduled[0].token_ids, plan.scheduled[0].start_position) == ([9, 50, 51], 7)
    num_blocks = len(s._block_manager.block_ids("a"))
    assert s.update_from_output(cont, {}, None, None) == []  # dropped: no tokens, no failure
    assert request.void_step_id is None and request.output_token_ids == [100, 101, 9]
    assert len(s._block_manager.block_ids("a")) == num_blocks  # the plan in flight still uses them
    s.update_from_output(plan, {"a": [50, 3]}, None, {"a": []})  # 50 accepted, 51 not: 3 instead
    assert request.output_token_ids == [100, 101, 9, 50, 3] and request.num_computed_tokens == 9


def test_async_continuation_after_all_drafts_accepted_is_kept():
    s = spec_scheduler(k=2, async_scheduling=True)
    prefill(s, [1, 2, 3, 4, 5], [101, 102])
    first = s.schedule()
    cont = s.schedule(after_step_id=first.step_id)
    s.update_from_output(first, {"a": [101, 102, 7]}, None, {"a": [8, 9]})
    request = s.get_request("a")
    assert request.void_step_id is None and request.num_computed_tokens == 11  # both steps' KV
    updates = s.update_from_output(cont, {"a": [8, 3]}, None, {"a": []})  # cont verified [8, 9]: 8 kept
    assert updates[0].new_token_ids == [8, 3]
    assert request.output_token_ids == [100, 101, 102, 7, 8, 3]
    assert request.num_computed_tokens == 10  # positions 0..9 hold tokens 0..9; 3 is computed next


def test_a_request_not_drafting_learns_from_its_first_drafts_fate_and_starts_drafting():
    policy = DraftPolicy(2, adaptive=True)
    s = Scheduler(
        BlockManager(64, BLOCK, enable_prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=256, async_scheduling=True, draft_policy=policy,
    )  # fmt: skip
    s.add_request(make_request("a", [1, 2, 3], max_tokens=100))
    plan = s.schedule()
    s.update_from_output(plan, {"a": [10]}, None, {"a": [11, 12]})
    num_drafts = []
    for t in range(11, 30):
        plan = s.schedule()
        (r,) = plan.scheduled
        num_drafts.append(r.num_draft_tokens)
        sampled = [t] + list(range(t + 1, t + 1 + r.num_draft_tokens))  # every draft comes true
        s.update_from_output(plan, {"a": sampled}, None, {"a": [t + 1 + r.num_draft_tokens, t + 2 + r.num_draft_tokens]})
        if len(s.get_request("a").output_token_ids) > 60:
            break
    assert num_drafts[0] == 0  # the prior (0.5) does not pay with async scheduling
    assert policy.acceptance("a") > 0.9
    assert num_drafts[-1] == 2
