"""`SpecDecodeScheduling`: the scheduler's speculative-decoding half, kept apart from batching policy.

A decode step may also verify the drafts the proposer made from the
request's latest output (`draft_token_ids` of `update_from_output`); the
`DraftPolicy` says how many (`_num_drafts`). They are scheduled after its
last token (`ScheduledRequest.num_draft_tokens`), within the token budget,
`max_tokens` and `max_model_len`, with KV allocated for them, but never enter
`all_token_ids`, so never a block hash or a connector's save. The output
brings the accepted drafts and one more token; `num_computed_tokens` and the
blocks past it roll back over the rejected ones (`_apply_verification`).

With async scheduling a drafting request is continued before that output is
back, optimistically: the next plan holds placeholders for the token plan S
samples and for the drafts its proposer makes, at the positions they take if
S accepts all of its drafts (the first stage fills them in from the last
stage, and the last stage verifies them against its own proposals). If S
rejects any, that continuation is void: its rows are computed past the valid
KV and dropped (`_take_void`). The request goes on at once from its accepted
tokens, in any later plan (its rows there overwrite the void ones: stages run
plans in order); only its blocks wait for the void plan to be back before
they are trimmed.

A step that verified no draft still tells the policy what its first draft
would have met (the token it sampled), so acceptance is known for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncpp.core.plan import ScheduledRequest
from asyncpp.core.request import Request
from asyncpp.speculative.policy import DraftPolicy

if TYPE_CHECKING:
    from asyncpp.kv.block_manager import BlockManager


class SpecDecodeScheduling:
    """Mixed into `Scheduler`, which reads `draft_policy` and calls these while building and applying plans."""

    _block_manager: BlockManager
    max_model_len: int
    async_scheduling: bool

    def _init_spec_decode(self, draft_policy: DraftPolicy | None) -> None:
        self.draft_policy = draft_policy
        k = draft_policy.num_speculative_tokens if draft_policy is not None else 0
        self._spec_counts = [0, 0, 0]  # drafts (request steps), draft tokens, accepted tokens
        self._spec_accepted_per_pos = [0] * k

    def _spec_decode_stats(self) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": self._spec_counts[0],
            "spec_decode_num_draft_tokens": self._spec_counts[1],
            "spec_decode_num_accepted_tokens": self._spec_counts[2],
            "spec_decode_num_accepted_tokens_per_pos": list(self._spec_accepted_per_pos),
        }

    def _take_void(self, request: Request, step_id: int) -> bool:
        """Is plan `step_id` a void continuation of `request`? Then it is done with, and dropped."""
        if request.void_step_id != step_id:
            return False
        request.void_step_id = None
        if not request.is_in_flight:  # (it may have gone on meanwhile, in a later plan)
            request.num_draft_tokens = 0
            self._block_manager.trim(request.request_id, request.num_computed_tokens + 1)
        return True

    def _apply_verification(
        self, request: Request, step_id: int, scheduled: ScheduledRequest, token_ids: list[int]
    ) -> None:
        """Plan `step_id` sampled `token_ids` for `request`: roll back over the drafts it rejected, or,
        verifying none, tell the policy what the first draft would have met."""
        if scheduled.num_draft_tokens:
            self._roll_back_rejected(request, step_id, scheduled, len(token_ids) - 1)
        elif request.draft_token_ids:
            self.draft_policy.observe_acceptance(request.request_id, 1, int(token_ids[0] == request.draft_token_ids[0]))

    def _num_drafts(self, request: Request, num_in_flight: int, num_budget: int, num_step_reqs: int) -> int:
        """How many drafts a decode step of `request` verifies: what the policy wants of those its latest
        output brought (a continuation: as many as its plan in flight will propose), such that the step
        passes neither `max_tokens` nor `max_model_len` nor the token budget (`num_budget`, its decode
        token included). `num_in_flight`: tokens its plan in flight samples first, if all accepted."""
        num_room = min(
            request.sampling_params.max_tokens - request.num_output_tokens - num_in_flight - 1,
            self.max_model_len - request.num_tokens - num_in_flight - 1,
            num_budget - 1,
        )
        num_available = min(len(request.draft_token_ids), num_room)
        return self.draft_policy.num_drafts(request.request_id, num_available, num_step_reqs, self.async_scheduling)

    def _roll_back_rejected(
        self, request: Request, step_id: int, scheduled: ScheduledRequest, num_accepted: int
    ) -> None:
        """Plan `step_id` verified the drafts of `scheduled` and accepted `num_accepted`: the KV of the
        rejected ones is not the request's (computed from wrong tokens), and the blocks holding only
        them go. A continuation in flight, placed after all of them, is void."""
        num_drafts = scheduled.num_draft_tokens
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(
                f"request {request.request_id!r}: {num_accepted} drafts accepted of the {num_drafts} verified"
            )
        if request.last_step_id == step_id:
            request.num_draft_tokens = 0
        if num_accepted < num_drafts:
            if request.is_in_flight:  # its continuation computed from positions the request never reaches
                request.void_step_id = request.last_step_id
                request.num_placeholders = 0
                request.num_draft_tokens = 0
            # Valid KV: up to the step's start, then its tokens before the drafts and the accepted drafts.
            request.num_computed_tokens = scheduled.start_position + scheduled.num_tokens - num_drafts + num_accepted
        if not request.is_in_flight:
            # Its next step's slot (the token sampled now) stays; blocks only past it hold drafts.
            self._block_manager.trim(request.request_id, request.num_computed_tokens + 1)
        self.draft_policy.observe_acceptance(request.request_id, num_drafts, num_accepted)
        counts = self._spec_counts
        counts[0] += 1
        counts[1] += num_drafts
        counts[2] += num_accepted
        for pos in range(num_accepted):
            self._spec_accepted_per_pos[pos] += 1
