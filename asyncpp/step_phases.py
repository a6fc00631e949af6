"""`StepPhases`: where a process spends each step, phase by phase (opt-in: `ASYNCPP_STEP_PHASES=1`).

A stage process charges the host time between two phase boundaries to the
phase that just ended (`mark`: waiting for the plan, input preparation, the
forward's launch or graph replay, sampling with its copy of the tokens to the
host, the hand-off, sending the output, ...); the engine charges the calls it
times (`add`: scheduling, sending the plan, applying the output, delivering
deltas). On CUDA, `gpu_begin` / `gpu_end` also bracket the work enqueued on
the current stream with timing events, read once they have completed
(`query`, never a synchronisation in the step), so the GPU time of the
forward and of the sampling sits next to the host time that enqueued it.

At close each process logs one `step_phases` event: per phase, milliseconds
per step (host; GPU where bracketed) and how many calls. `python -m
asyncpp.bench.step_phases` launches an engine with this on, serves a load and
prints the events as one table. Off (the default), every call goes to
`NO_PHASES`, which does nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

ENV_VAR = "ASYNCPP_STEP_PHASES"


class StepPhases:
    def __init__(self, device_type: str = "cpu", clock=time.perf_counter) -> None:
        self.host_s: dict[str, float] = {}
        self.gpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.num_steps = 0
        self._clock = clock
        self._last = clock()
        self._is_cuda = device_type == "cuda"
        self._open: dict[str, Any] = {}  # phase -> its start event
        self._pending: list[tuple[str, Any, Any]] = []  # (phase, start event, end event) not yet read

    def start_step(self) -> None:
        """A step begins (its first boundary is the caller's last `mark`)."""
        self.num_steps += 1
        if self._pending:
            self._read_events(wait=False)

    def mark(self, phase: str) -> None:
        """The time since the previous boundary was spent in `phase` (before the first step: start-up,
        not charged)."""
        now = self._clock()
        if self.num_steps:
            self.add(phase, now - self._last)
        self._last = now

    def add(self, phase: str, seconds: float) -> None:
        self.host_s[phase] = self.host_s.get(phase, 0.0) + seconds
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def gpu_begin(self, phase: str) -> None:
        if self._is_cuda:
            self._open[phase] = _record()

    def gpu_end(self, phase: str) -> None:
        start = self._open.pop(phase, None)
        if start is not None:
            self._pending.append((phase, start, _record()))

    def _read_events(self, wait: bool) -> None:
        unread = []
        for phase, start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                unread.append((phase, start, end))
                continue
            self.gpu_s[phase] = self.gpu_s.get(phase, 0.0) + start.elapsed_time(end) / 1e3
        self._pending = unread

    def summary(self) -> dict[str, Any]:
        """`{"num_steps": n, "phases": {phase: {"host_ms": per step, "gpu_ms": per step, "calls": n}}}`."""
        self._read_events(wait=True)
        per_step = 1e3 / max(1, self.num_steps)
        phases: dict[str, dict[str, Any]] = {}
        for phase in {**self.host_s, **self.gpu_s}:
            entry: dict[str, Any] = {"calls": self.calls.get(phase, 0)}
            if phase in self.host_s:
                entry["host_ms"] = round(self.host_s[phase] * per_step, 4)
            if phase in self.gpu_s:
                entry["gpu_ms"] = round(self.gpu_s[phase] * per_step, 4)
            phases[phase] = entry
        return {"num_steps": self.num_steps, "phases": phases}


class _NoPhases:
    """Step phases off: every call does nothing."""

    num_steps = 0

    def start_step(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def add(self, phase: str, seconds: float) -> None:
        pass

    def gpu_begin(self, phase: str) -> None:
        pass

    def gpu_end(self, phase: str) -> None:
        pass


NO_PHASES = _NoPhases()


def step_phases(device: str = "cpu") -> StepPhases | _NoPhases:
    """A `StepPhases` when `ASYNCPP_STEP_PHASES=1`, else `NO_PHASES`; `device` ("cpu", "cuda:1")
    says whether to bracket GPU work."""
    return StepPhases(str(device).split(":")[0]) if os.environ.get(ENV_VAR) == "1" else NO_PHASES


def _record() -> Any:
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
