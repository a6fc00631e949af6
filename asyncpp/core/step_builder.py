"""`StepBuilder`: one plan's requests as the scheduler adds them, within the step's budgets.

The scheduler decides who runs and how many tokens each computes; the builder
turns each choice into a `ScheduledRequest` and advances the request's
bookkeeping at once (its tokens count as computed: the stages are writing that
KV), so the next choice sees the budgets and the request as they now are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncpp.core.plan import PLACEHOLDER_TOKEN_ID, NewRequestData, ScheduledRequest
from asyncpp.core.request import Request


@dataclass
class StepBuilder:
    step_id: int
    num_budget_tokens: int
    max_num_reqs: int | None
    num_prefill_budget: int  # prompt tokens (every token but a lone decode one) still allowed
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    cohort: list[Request] = field(default_factory=list)  # parallel to `scheduled`
    new_requests: list[NewRequestData] = field(default_factory=list)
    has_placeholders: bool = False
    # Requests added while `is_floating`: they do not count against this plan's `max_num_reqs`.
    num_floating: int = 0

    @property
    def has_room(self) -> bool:
        """Room for one more request of this plan's own (not a floating chunk)."""
        return self.num_budget_tokens > 0 and (
            self.max_num_reqs is None or len(self.scheduled) - self.num_floating < self.max_num_reqs
        )

    def add(
        self,
        request: Request,
        num_new_tokens: int,
        block_ids: list[int],
        num_placeholders: int = 0,
        draft_token_ids: list[int] | None = None,
        num_draft_placeholders: int = 0,
    ) -> None:
        """Schedule `num_new_tokens` of `request` from its first uncomputed one; with placeholders,
        that many tokens the plan in flight before this one samples (its first stage fills them in);
        with drafts, the last `len(draft_token_ids)` of them are those guesses, to be verified; with
        draft placeholders, that many drafts the plan before proposes (filled in like the tokens)."""
        start = request.num_computed_tokens
        end = start + num_new_tokens
        num_drafts = len(draft_token_ids) if draft_token_ids else num_draft_placeholders
        if request.is_floating:
            self.num_floating += 1
        if num_placeholders:
            token_ids = [PLACEHOLDER_TOKEN_ID] * (num_placeholders + num_draft_placeholders)
            self.has_placeholders = True
        else:
            token_ids = request.token_ids_between(start, end - num_drafts)
            if draft_token_ids:
                token_ids = token_ids + list(draft_token_ids)
        self.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=token_ids,
                start_position=start,
                block_ids=block_ids,
                # A continuation samples after the token its plan before samples; a chunk, at the last one.
                do_sample=bool(num_placeholders) or end - num_drafts == request.num_tokens + request.num_placeholders,
                num_draft_tokens=num_drafts,
            )
        )
        self.cohort.append(request)
        self.num_budget_tokens -= num_new_tokens
        request.num_computed_tokens = end
        request.num_placeholders += num_placeholders
        request.num_draft_tokens = num_drafts
        request.num_in_flight += 1
        request.last_step_id = self.step_id
