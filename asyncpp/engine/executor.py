"""`InProcessExecutor`: runs every stage of a plan in this process, in order.

Same two-phase contract as the pipeline runtime: each stage's
`execute_model`, the hand-off of `IntermediateTensors` to the next (a
non-last stage then ends its step with `finish_step`), then `sample_tokens`
on the last stage. Returns every stage's output, as the engine expects one
per stage per step (their KV connector reports are merged across stages).
"""

from __future__ import annotations

import time

from asyncpp.core.plan import StepPlan
from asyncpp.worker.model_runner import ModelRunner
from asyncpp.worker.outputs import ModelRunnerOutput


class InProcessExecutor:
    def __init__(self, runners: list[ModelRunner]) -> None:
        if not runners or not runners[-1].is_last:
            raise ValueError("the last runner must hold the model's last layers")
        self.runners = runners
        self.busy_s = [0.0] * len(runners)  # each stage's time in the latest step

    def execute(self, plan: StepPlan) -> list[ModelRunnerOutput]:
        """One output per stage, the last stage's (the sampled tokens) last."""
        outputs = []
        intermediate = None
        for rank, runner in enumerate(self.runners[:-1]):
            t0 = time.perf_counter()
            intermediate = runner.execute_model(plan, intermediate)
            outputs.append(runner.finish_step())
            self.busy_s[rank] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.runners[-1].execute_model(plan, intermediate)
        outputs.append(self.runners[-1].sample_tokens())
        self.busy_s[-1] = time.perf_counter() - t0
        return outputs

    def close(self) -> None:
        for runner in self.runners:
            runner.kv_connector.close()
