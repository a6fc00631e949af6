"""Step phases: the accumulator's arithmetic, and a launched engine whose every process reports them."""

from __future__ import annotations

import argparse

import pytest

from asyncpp.bench.runs import to_toml
from asyncpp.bench.step_phases import format_profile, profile
from asyncpp.step_phases import ENV_VAR, NO_PHASES, StepPhases, step_phases
from tests.runtime.harness import tiny_sections


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_marks_charge_the_time_since_the_last_boundary_and_sum_per_step():
    clock = Clock()
    phases = StepPhases(clock=clock)
    clock.now += 9.0
    phases.mark("wait_plan")  # start-up until the first plan: no step's, not charged
    for _ in range(2):
        phases.start_step()
        clock.now += 0.001
        phases.mark("prepare_inputs")
        clock.now += 0.003
        phases.mark("forward")
        phases.add("deliver", 0.0005)
        clock.now += 0.004
        phases.mark("wait_plan")
    summary = phases.summary()
    assert summary["num_steps"] == 2
    got = {name: p["host_ms"] for name, p in summary["phases"].items()}
    assert got == pytest.approx({"wait_plan": 4.0, "prepare_inputs": 1.0, "forward": 3.0, "deliver": 0.5})
    assert all(p["calls"] == 2 and "gpu_ms" not in p for p in summary["phases"].values())
    phases.gpu_begin("forward")  # a CPU process brackets nothing
    phases.gpu_end("forward")
    assert "gpu_ms" not in phases.summary()["phases"]["forward"]


def test_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert step_phases() is NO_PHASES
    NO_PHASES.mark("x")  # takes every call, keeps nothing
    NO_PHASES.start_step()
    assert NO_PHASES.num_steps == 0
    monkeypatch.setenv(ENV_VAR, "1")
    assert isinstance(step_phases(), StepPhases)


@pytest.mark.slow
def test_a_launched_engine_reports_every_process_phases(tmp_path, tiny_hf_dir):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir, 2, scheduler={"async_scheduling": True})))
    args = argparse.Namespace(num_prompts=6, input_len=8, output_len=8, seed=0)
    result = profile(config, tmp_path / "log.jsonl", 3, args)
    assert result["metrics"]["failed"] == 0
    processes = result["processes"]
    assert set(processes) == {"engine", "stage0", "stage1"}
    assert {"schedule", "send_plan", "process_output", "deliver"} <= set(processes["engine"]["phases"])
    assert {"wait_plan", "prepare_inputs", "forward", "handoff", "send_output"} <= set(processes["stage0"]["phases"])
    assert {"wait_activations", "forward", "sample", "send_output"} <= set(processes["stage1"]["phases"])
    for data in processes.values():
        assert data["num_steps"] > 0
        assert all(p["host_ms"] >= 0 for p in data["phases"].values())
    assert "stage1" in format_profile("tiny", result)


def test_a_cuda_stage_brackets_gpu_work(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    assert step_phases("cuda:1")._is_cuda and not step_phases("cpu")._is_cuda
