"""A stage after the first prepares its step (`ModelRunner.prepare_step`) before its activations
arrive, as a stage process does while it waits: the tokens must equal those of steps prepared by
`execute_model` itself, and the stage's busy time still counts the preparation."""

from __future__ import annotations

import types

import pytest

from asyncpp.core.plan import StepPlan
from asyncpp.engine.engine import Engine
from asyncpp.runtime.stage_process import Stage
from asyncpp.sampling.params import SamplingParams
from asyncpp.worker.outputs import ModelRunnerOutput
from tests.conftest import tiny_config, tiny_prompts

GREEDY = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
PP2 = {"pp_size": 2, "layer_split": (1, 3)}


def _generate_preparing_ahead(engine: Engine, prompts) -> tuple[list[list[int]], int]:
    """Run the engine's two in-process stages in a stage process's order: the last stage prepares each
    step before the first stage runs it. Returns the tokens by request and the steps prepared ahead."""
    first, last = engine.executor.runners
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    num_ahead = 0
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        if plan is None:
            continue
        last.prepare_step(plan)
        num_ahead += last.prepared is not None and last.prepared[1] is not None
        intermediate = first.execute_model(plan)
        outputs = [first.finish_step()]
        last.execute_model(plan, intermediate)
        assert last.prepared is None  # the prepared inputs are used once
        outputs.append(last.sample_tokens())
        for out in engine.process_output(plan, outputs):
            tokens[out.request_id].extend(out.token_ids)
    return [tokens[i] for i in ids], num_ahead


def test_steps_prepared_ahead_give_the_same_tokens(tiny_hf_dir):
    prompts = tiny_prompts(320, 6, seed=4)
    expected = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir, parallel=PP2)).generate(prompts, [GREEDY] * 6)]
    engine = Engine(tiny_config(tiny_hf_dir, parallel=PP2, scheduler={"max_num_batched_tokens": 32}))
    got, num_ahead = _generate_preparing_ahead(engine, prompts)
    assert got == expected
    assert num_ahead > 10  # prompt chunks and decode steps alike


def _first_step_prepared(tiny_hf_dir):
    """Two in-process stages, one request, its first plan prepared ahead on the last stage."""
    engine = Engine(tiny_config(tiny_hf_dir, parallel=PP2))
    first, last = engine.executor.runners
    engine.add_request(tiny_prompts(320, 1)[0], GREEDY)
    plan = engine.scheduler.schedule()
    last.prepare_step(plan)
    return first, last, plan


def test_a_step_prepared_for_another_plan_refuses_to_run(tiny_hf_dir):
    _, last, plan = _first_step_prepared(tiny_hf_dir)
    other = StepPlan(plan.step_id + 1, plan.scheduled)
    with pytest.raises(RuntimeError, match=f"execute_model\\(step {other.step_id}\\) before sample_tokens of step {plan.step_id}"):
        last.execute_model(other)


def test_an_aborted_step_drops_its_prepared_inputs(tiny_hf_dir):
    first, last, plan = _first_step_prepared(tiny_hf_dir)
    last.abort_step(plan)
    assert last.prepared is None and last.execute_state is None
    last.prepare_step(plan)  # the same plan again, as after a failed step: no stale state in the way
    last.execute_model(plan, first.execute_model(plan))
    assert last.sample_tokens().req_ids == [plan.scheduled[0].request_id]


def test_an_empty_plan_is_prepared_with_no_inputs(tiny_hf_dir):
    engine = Engine(tiny_config(tiny_hf_dir, parallel=PP2))
    _, last = engine.executor.runners
    plan = StepPlan(0, [])
    last.prepare_step(plan)
    assert last.prepared == (0, None)
    assert last.execute_model(plan) is None and last.prepared is None
    assert last.sample_tokens().req_ids == []


def test_the_stage_reports_its_preparation_as_busy_time():
    stage = types.SimpleNamespace(is_debug=False, args=types.SimpleNamespace(pp_rank=1))
    plan = StepPlan(7, [])
    output = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[5]])
    out = Stage._stage_output(stage, plan, output, 10.0, 10.25, 3.5, "stage 1: boom", prepare_s=0.5)
    assert (out.step_id, out.pp_rank, out.busy_s, out.handoff_us, out.error) == (7, 1, 0.75, 3.5, "stage 1: boom")
    assert out.output is output
    assert Stage._stage_output(stage, plan, ModelRunnerOutput(), 10.0, 10.25, 0.0, None).busy_s == 0.25


def test_the_stage_done_event_gives_the_slice_and_the_busy_time():
    events = []
    log = types.SimpleNamespace(debug=lambda event, **fields: events.append((event, fields)))
    stage = types.SimpleNamespace(
        is_debug=True, log=log, args=types.SimpleNamespace(pp_rank=1), threads=types.SimpleNamespace(current=2)
    )
    plan = StepPlan(7, [])
    Stage._stage_output(stage, plan, ModelRunnerOutput(), 10.0, 10.25, 12.34, None, prepare_s=0.5004321)
    [(event, fields)] = events
    assert event == "stage_done"
    assert fields == {
        "step_id": 7, "num_tokens": 0, "num_reqs": 0, "start_us": 10_000_000, "end_us": 10_250_000,
        "busy_ms": pytest.approx(750.432, abs=1e-6), "prepare_ms": pytest.approx(500.432, abs=1e-6),
        "handoff_us": pytest.approx(12.3, abs=1e-9), "num_threads": 2,
    }  # fmt: skip (milliseconds to 3 decimals, microseconds to 1)
