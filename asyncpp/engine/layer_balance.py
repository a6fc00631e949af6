"""`LayerBalancer`: where each pipeline stage starts a step (`parallel.shift_layers`).

With a fixed split, the stages' shares of a step depend on what the step holds.
The last stage also runs lm_head and sampling once per sampled row, so it is the
busier one on decode-only steps. Prompt chunks (many tokens, one sampled row)
load the earlier stages more. The busier stage sets the pipeline's pace and the
others idle for the difference (on SmolLM2 with pp = 2, 18/12: the last stage
takes 1.23x the first's time on decode steps, 0.74x on prompt steps).

Each boundary may move within a window of layers that both neighbouring stages
hold (weights loaded by both, KV cache shared; `asyncpp.model.split`). Every
step gets the boundaries that even out its predicted stage times.

Cost model, per stage and step, in milliseconds:
    layers run * (a * tokens + b * attention + c) + [last stage] (d * sampled rows + e)
where attention = sum over requests of tokens * context. The weights are
fitted online by recursive least squares to the busy times the stages report,
forgetting old steps. They start from a prior drawn from parameter counts, so
the split follows the machine and the load. Placement changes which process
runs a layer, never what it computes, as long as two steps that share KV blocks
reach each shared layer in step order: `asyncpp.engine.kv_order` lowers the
chosen bounds where an in-flight step could race with the new one.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np

from asyncpp.core.plan import StepPlan
from asyncpp.engine.kv_order import ordered_bounds
from asyncpp.model.arch import ModelArch

# Feature units, so that every feature of a typical step is of order 1 (RLS conditioning).
TOKEN_UNIT = 64
ATTENTION_UNIT = 64 * 1024  # tokens x context
SAMPLE_UNIT = 16
# Prior rates for the initial weights (the fit replaces them within a few dozen steps).
PRIOR_LINEAR_MACS_PER_S = 50e9
PRIOR_ATTENTION_MACS_PER_S = 10e9
PRIOR_LAYER_MS = 0.02
PRIOR_LAST_STAGE_MS = 0.2
FORGETTING = 0.99  # about the last 100 observations count
PRIOR_VARIANCE = 10.0


class LayerBalancer:
    """Per-step stage boundaries within `windows`, from a cost model fitted to stage busy times."""

    def __init__(self, arch: ModelArch, ranges: list[tuple[int, int]], windows: list[tuple[int, int]]) -> None:
        """`ranges`: the static split; `windows`: per boundary, the (lowest, highest) start of the next stage."""
        if len(windows) != len(ranges) - 1:
            raise ValueError(f"{len(windows)} shift windows for {len(ranges)} stages")
        self.num_layers = ranges[-1][1]
        self.static_bounds = tuple(start for start, _ in ranges[1:])
        self.windows = list(windows)
        attention_macs = 2 * arch.num_heads * arch.head_dim  # q.k and p.v per token and context position
        head_macs = arch.vocab_size * arch.hidden_size
        self.theta = np.array(
            [
                arch.layer_params * TOKEN_UNIT / PRIOR_LINEAR_MACS_PER_S * 1e3,
                attention_macs * ATTENTION_UNIT / PRIOR_ATTENTION_MACS_PER_S * 1e3,
                PRIOR_LAYER_MS,
                head_macs * SAMPLE_UNIT / PRIOR_LINEAR_MACS_PER_S * 1e3,
                PRIOR_LAST_STAGE_MS,
            ]
        )
        self.covariance = np.eye(5) * PRIOR_VARIANCE
        self.bounds_counts: collections.Counter[tuple[int, ...]] = collections.Counter()
        self.num_observed = 0

    # ---- choosing ---------------------------------------------------------------------------
    def bounds(self, plan: StepPlan, in_flight: Iterable[StepPlan] = ()) -> tuple[int, ...]:
        """Where stages 1.. start this step: the predicted stage times as even as the windows allow,
        lowered where a step still `in_flight` shares KV blocks with it (`kv_order`)."""
        chosen = ordered_bounds(self.wanted_bounds(plan), plan, in_flight, self.static_bounds)
        self.bounds_counts[chosen] += 1
        return chosen

    def wanted_bounds(self, plan: StepPlan) -> tuple[int, ...]:
        """The cost model's bounds for `plan`, before any ordering constraint."""
        tokens, attention, samples = _step_features(plan)
        a, b, c, d, e = np.maximum(self.theta, 0.0)
        per_layer = a * tokens + b * attention + c
        last_extra = d * samples + e
        starts = list(self.static_bounds)
        if per_layer <= 0.0:
            return tuple(starts)
        for _ in range(2):  # pairwise passes; one is exact for pp = 2
            for i, (lo, hi) in enumerate(self.windows):
                begin = starts[i - 1] if i > 0 else 0
                end = starts[i + 1] if i + 1 < len(starts) else self.num_layers
                extra = last_extra if i + 1 == len(starts) else 0.0
                starts[i] = _balance_pair(begin, end, lo, hi, per_layer, extra)
        return tuple(starts)

    # ---- fitting ----------------------------------------------------------------------------
    def observe(self, plan: StepPlan, busy_s: list[float]) -> None:
        """Fit the model to one completed step's busy time on every stage (`plan.layer_bounds` as run).

        Steps run with lent threads (a lone cohort) are left out: their stage times are not the
        ones two cohorts in flight see."""
        if plan.is_empty or plan.num_threads or len(busy_s) != len(self.windows) + 1:
            return
        tokens, attention, samples = _step_features(plan)
        starts = [0, *(plan.layer_bounds or self.static_bounds), self.num_layers]
        for rank, busy in enumerate(busy_s):
            layers = starts[rank + 1] - starts[rank]
            is_last = rank == len(busy_s) - 1
            x = np.array([layers * tokens, layers * attention, layers, samples * is_last, float(is_last)])
            self._update(x, busy * 1e3)
        self.num_observed += 1

    def _update(self, x: np.ndarray, y: float) -> None:
        """One recursive least squares step with forgetting; the covariance is kept bounded."""
        px = self.covariance @ x
        gain = px / (FORGETTING + x @ px)
        self.theta = self.theta + gain * (y - x @ self.theta)
        self.covariance = (self.covariance - np.outer(gain, px)) / FORGETTING
        trace = np.trace(self.covariance)
        if trace > 5 * PRIOR_VARIANCE:  # little new information lately: do not let it wind up
            self.covariance *= 5 * PRIOR_VARIANCE / trace

    def stats(self) -> dict:
        """The fitted weights and how often each split was chosen, for `client.stats()`."""
        return {
            "cost_weights_ms": [round(float(w), 5) for w in self.theta],
            "num_observed_steps": self.num_observed,
            "bounds_counts": {",".join(map(str, k)): v for k, v in sorted(self.bounds_counts.items())},
        }


def _step_features(plan: StepPlan) -> tuple[float, float, float]:
    """(tokens, attention, sampled rows) of a step, in the model's units."""
    tokens = attention = samples = 0
    for r in plan.scheduled:
        n = r.num_tokens
        tokens += n
        attention += n * (r.start_position + n)
        samples += r.do_sample
    return tokens / TOKEN_UNIT, attention / ATTENTION_UNIT, samples / SAMPLE_UNIT


def _balance_pair(begin: int, end: int, lo: int, hi: int, per_layer: float, extra: float) -> int:
    """The start s of the later of two neighbouring stages, lo <= s <= hi, that minimises
    max((s - begin) * per_layer, (end - s) * per_layer + extra)."""
    ideal = (begin + end + extra / per_layer) / 2
    candidates = {min(max(s, lo), hi) for s in (int(ideal), int(ideal) + 1)}
    return min(candidates, key=lambda s: (max((s - begin) * per_layer, (end - s) * per_layer + extra), s))
