"""`InProcessExecutor`: runs every stage of a plan in this process, in order.

Same two-phase contract as the pipeline runtime: each stage's
`execute_model`, the hand-off of `IntermediateTensors` to the next, then
`sample_tokens` on the last stage.
"""

from __future__ import annotations

from asyncpp.core.plan import StepPlan
from asyncpp.worker.model_runner import ModelRunner
from asyncpp.worker.outputs import ModelRunnerOutput


class InProcessExecutor:
    def __init__(self, runners: list[ModelRunner]) -> None:
        if not runners or not runners[-1].is_last:
            raise ValueError("the last runner must hold the model's last layers")
        self.runners = runners

    def execute(self, plan: StepPlan) -> ModelRunnerOutput:
        intermediate = None
        for runner in self.runners:
            intermediate = runner.execute_model(plan, intermediate)
        return self.runners[-1].sample_tokens()
