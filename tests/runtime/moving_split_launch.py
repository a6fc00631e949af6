"""`python -m tests.runtime.moving_split_launch`: the launcher with a split and lent threads that change every step.

Hooks, so that what the load would vary is made to vary on purpose:
* the balancer wants a boundary drawn at random (seeded by the step id) anywhere
  in each shift window, every step (`LayerBalancer.wanted_bounds`); the engine's
  ordering of shared layers (`asyncpp.engine.kv_order`) still applies;
* a lone cohort's steps get every stage's threads or only their own, by turns
  (`StepWindow._lent_threads`);
* the last stage sleeps `LAST_STAGE_DELAY_S` before each step with more than one
  token, so that the first stage always runs the next prompt chunk ahead of it
  (what a busy core did by chance).
Everything else is the real launcher.
"""

from __future__ import annotations

import itertools
import random
import sys
import time

import asyncpp.runtime.stage_group
from asyncpp.engine.layer_balance import LayerBalancer
from asyncpp.launch import main
from asyncpp.runtime.stage_process import StageArgs, stage_main
from asyncpp.runtime.step_window import StepWindow

LAST_STAGE_DELAY_S = 0.03


def _random_bounds(self: LayerBalancer, plan) -> tuple[int, ...]:
    rng = random.Random(plan.step_id)
    bounds, floor = [], 0
    for lo, hi in self.windows:
        bounds.append(rng.randint(max(lo, floor), hi))
        floor = bounds[-1] + 1
    return tuple(bounds)


_lent = itertools.cycle((True, False))


def _turns_of_lent_threads(self: StepWindow) -> int:
    return self.max_lent_threads if next(_lent) else 0


def slow_last_stage_main(args: StageArgs) -> None:
    """`stage_main`, the last stage running late on prompt steps."""
    if args.is_last:
        from asyncpp.worker.model_runner import ModelRunner

        execute = ModelRunner.execute_model

        def late(self, plan, intermediate=None):
            if plan.num_tokens > 1:
                time.sleep(LAST_STAGE_DELAY_S)
            return execute(self, plan, intermediate)

        ModelRunner.execute_model = late
    stage_main(args)


if __name__ == "__main__":
    LayerBalancer.wanted_bounds = _random_bounds
    StepWindow._lent_threads = _turns_of_lent_threads
    asyncpp.runtime.stage_group.stage_main = slow_last_stage_main
    sys.exit(main())
