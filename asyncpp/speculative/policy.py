"""`DraftPolicy`: how many of a request's drafts its next step verifies, so that drafting never costs.

A draft is worth its row when the tokens it is expected to add are worth more
than the time the wider step takes. Both sides are measured:

* acceptance, per request: the chance that a draft is accepted given the one
  before it was (accepted / positions tried), a decaying average over its
  recent steps that starts at `PRIOR_ACCEPTANCE`; with it, draft j of a request
  is accepted with probability `alpha ** j`. A step that verified no draft
  still tells: the token it sampled is the first draft's fate (the scheduler
  reports it as one position tried), so a request that does not draft keeps
  an estimate for free and starts drafting when its drafts would pay;
* cost, over the engine's steps: step time ~ `a + b * num_tokens`, a
  least-squares fit with exponential forgetting of (tokens, seconds) pairs.
  With R requests in a step, a row costs `c = b * R / (a + b * R)` tokens
  (what the batch makes in the time the row takes).

With d drafts a step brings the request `E(d) = 1 + alpha + ... + alpha ** d`
tokens for `d * c`. With async scheduling its next step is already planned
after all d drafts: a rejection (chance `1 - alpha ** d`) voids that step,
which then brings nothing, so a step brings `E(d) / (2 - alpha ** d)` on
average. The policy takes the d (up to what the proposer found) with the most
tokens net of the rows' cost; without async scheduling that is every draft j
with `alpha ** j > c`.

On a CPU at concurrency 1 a row costs little next to reading the weights
(`c` is small): every draft the proposer found goes in. At high concurrency
rows are most of the step: only requests whose drafts are usually accepted
keep drafting, and the rest run as if speculation were off. Without `adaptive`, every
draft found goes in (tests, measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0  # positions' worth of belief in the prior: a short streak of luck does not start drafting
DECAY = 0.95  # per step of a request, on its acceptance counts (about the last 20 count)
COST_DECAY = 0.995  # per observed step, on the cost fit
MIN_COST_STEPS = 8  # before this many steps, the prior row cost below
PRIOR_ROW_COST = 0.02  # b / a before the fit has data: a row next to reading the weights on a CPU


@dataclass
class _Acceptance:
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    tried: float = PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


class StepCost:
    """Step seconds ~ a + b * tokens, fit over recent steps (older ones weigh less)."""

    def __init__(self, decay: float = COST_DECAY) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.num_steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0.0:
            return
        d = self.decay
        x, y = float(num_tokens), seconds
        self.n, self.sx, self.sy = d * self.n + 1.0, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before there is enough spread in step sizes to fit."""
        if self.num_steps < MIN_COST_STEPS:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var_x = self.sxx / self.n - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            return None
        b = max(0.0, (self.sxy / self.n - mean_x * mean_y) / var_x)
        a = max(mean_y - b * mean_x, 1e-3 * mean_y)  # a step never costs nothing
        return a, b

    def row_cost(self, num_reqs: int) -> float:
        """What one more row costs, as a fraction of the output of a step of `num_reqs` decodes."""
        fit = self.coefficients()
        if fit is None:
            a, b = 1.0, PRIOR_ROW_COST
        else:
            a, b = fit
        num_reqs = max(1, num_reqs)
        return b * num_reqs / (a + b * num_reqs)


class DraftPolicy:
    def __init__(self, num_speculative_tokens: int, adaptive: bool = True) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive
        self.cost = StepCost()
        self._acceptance: dict[str, _Acceptance] = {}

    def num_drafts(self, request_id: str, num_available: int, num_reqs: int, is_continued: bool = False) -> int:
        """How many of `num_available` drafts (the proposer's, within the budgets) to verify now;
        `is_continued`: the request's next step is planned before this one is back (async scheduling)."""
        limit = min(num_available, self.num_speculative_tokens)
        if limit <= 0 or not self.adaptive:
            return max(0, limit)
        alpha = self.acceptance(request_id)
        cost = self.cost.row_cost(num_reqs)
        n, best = 0, 1.0  # no draft: one token a step, never void
        tokens, p = 1.0, 1.0  # E(d) and alpha ** d
        for d in range(1, limit + 1):
            p *= alpha
            tokens += p
            net = (tokens / (2.0 - p) if is_continued else tokens) - d * cost
            if net > best:
                n, best = d, net
        return n

    def acceptance(self, request_id: str) -> float:
        acc = self._acceptance.get(request_id)
        return acc.rate if acc is not None else PRIOR_ACCEPTANCE

    def observe_acceptance(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` of the request's drafts and accepted the first `num_accepted`
        (or, verifying none, sampled what its first draft was: 1 and 1, or 1 and 0)."""
        if num_drafts <= 0:
            return
        acc = self._acceptance.setdefault(request_id, _Acceptance())
        tried = num_accepted + (1 if num_accepted < num_drafts else 0)
        acc.accepted = DECAY * acc.accepted + num_accepted
        acc.tried = DECAY * acc.tried + tried

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
