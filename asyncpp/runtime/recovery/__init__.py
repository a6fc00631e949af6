"""Restarting the stages in place when one dies or hangs, so that every request still finishes.

`PipelineSupervisor` watches the stages (a process exit, the step deadline),
and on a loss pauses the step window, requeues every request for recompute
(`asyncpp.core.scheduler_recovery`), restarts the stage processes and resumes,
within `RestartBudget`; past it, or where a restart cannot keep its promise
(a KV connector, the Ray backend), the engine fails every request and stops.
"""

from asyncpp.runtime.recovery.budget import RestartBudget
from asyncpp.runtime.recovery.supervisor import PipelineSupervisor

__all__ = ["PipelineSupervisor", "RestartBudget"]
