"""`InProcessExecutor`: runs every stage of a plan in this process, in order.

Same two-phase contract as the pipeline runtime: each stage's
`execute_model`, the hand-off of `IntermediateTensors` to the next (a
non-last stage then ends its step with `finish_step`), then `sample_tokens`
on the last stage. Returns every stage's output, as the engine expects one
per stage per step (their KV connector reports are merged across stages).

A stage whose step raises ends it with `abort_step` (its KV connector still
starts, ends and reports its transfers), and so does every later stage,
which gets no activations: like a stage process, it reports an error
instead of raising, so the engine fails only that step's requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from asyncpp.core.plan import StepPlan
from asyncpp.worker.model_runner import ModelRunner
from asyncpp.worker.outputs import ModelRunnerOutput


@dataclass(frozen=True)
class ExecutedStep:
    outputs: list[ModelRunnerOutput]  # one per stage, the last stage's (the sampled tokens) last
    errors: list[str]  # empty unless some stage failed the step


class InProcessExecutor:
    def __init__(self, runners: list[ModelRunner]) -> None:
        if not runners or not runners[-1].is_last:
            raise ValueError("the last runner must hold the model's last layers")
        self.runners = runners
        self.busy_s = [0.0] * len(runners)  # each stage's time in the latest step

    def execute(self, plan: StepPlan) -> ExecutedStep:
        outputs: list[ModelRunnerOutput] = []
        errors: list[str] = []
        intermediate = None
        for rank, runner in enumerate(self.runners):
            t0 = time.perf_counter()
            if errors:  # an earlier stage failed: no activations reach this one
                outputs.append(runner.abort_step(plan))
                continue
            try:
                intermediate = runner.execute_model(plan, intermediate)
                outputs.append(runner.sample_tokens() if runner.is_last else runner.finish_step())
            except Exception as e:  # noqa: BLE001 - reported, as a stage process reports it
                errors.append(f"stage {rank}: {type(e).__name__}: {e}")
                outputs.append(runner.abort_step(plan))
            self.busy_s[rank] = time.perf_counter() - t0
        return ExecutedStep(outputs, errors)

    def close(self) -> None:
        for runner in self.runners:
            runner.kv_connector.close()
