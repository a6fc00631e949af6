"""Greedy outputs through the async client equal the in-process engine, for pp = 1, 2, 3."""

from __future__ import annotations

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect_all
from tests.runtime.harness import launched, tiny_sections

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(320, 8)


@pytest.fixture(scope="module")
def in_process(tiny_hf_dir, prompts):
    return [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]


@pytest.mark.parametrize("pp_size,layer_split", [(1, ()), (2, (1, 3)), (3, (1, 1, 2))])
async def test_pipeline_equals_in_process(tmp_path, tiny_hf_dir, prompts, in_process, pp_size, layer_split):
    with launched(tmp_path, tiny_sections(tiny_hf_dir, pp_size, layer_split)) as engine:
        await _assert_equals_in_process(engine.address, prompts, in_process, pp_size)


async def test_shared_pp2_engine_equals_in_process(shared_pp2_engine, prompts, in_process):
    """pp = 2 split (2, 2): the session's shared engine (launched with exactly that config)."""
    await _assert_equals_in_process(shared_pp2_engine.address, prompts, in_process, 2)


async def _assert_equals_in_process(address: str, prompts, in_process, pp_size: int) -> None:
    results, stats = await collect_all(address, prompts, GREEDY)
    assert [r[0] for r in results] == in_process
    assert all(r[2] == "length" for r in results)
    assert len(stats["stage_busy_s"]) == pp_size
    assert stats["num_kv_blocks"] > 0 and stats["num_running"] == 0


def test_in_process_equals_transformers(prompts, in_process, hf_tiny_model):
    """With the test above, the pipeline's tokens equal transformers' (one prompt here; the in-process
    engine is checked for all in tests/engine). Apart, so the pipeline runs without transformers."""
    import torch

    out = hf_tiny_model.generate(
        torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert in_process[0] == out[0, len(prompts[0]) :].tolist()


def _max_steps_in_flight(log_file) -> int:
    """The most steps dispatched and not yet completed at once, from the engine's debug events."""
    import json

    in_flight, most = set(), 0
    for line in log_file.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "step_dispatched":
            in_flight.add(event["step_id"])
            most = max(most, len(in_flight))
        elif event.get("event") == "step_completed":
            in_flight.discard(event["step_id"])
    return most


@pytest.mark.parametrize(
    "max_steps_in_flight,async_scheduling,expected_window",
    [(0, False, 2), (1, False, 1), (3, False, 3), (0, True, 4), (1, True, 2)],
)
async def test_window_and_stage_niceness(
    tmp_path, tiny_hf_dir, prompts, in_process, max_steps_in_flight, async_scheduling, expected_window
):
    """The engine never has more steps out than the window (cohorts, default pp_size, times two with
    async scheduling) and fills it, whatever its size the outputs are unchanged, and the stages run
    at the configured lower CPU priority."""
    import os

    parallel = {"max_steps_in_flight": max_steps_in_flight, "stage_nice": 3}
    scheduler = {"async_scheduling": async_scheduling}
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    with launched(tmp_path, tiny_sections(tiny_hf_dir, 2, (2, 2), parallel=parallel, scheduler=scheduler)) as engine:
        results, stats = await collect_all(engine.address, prompts, GREEDY)
        stage_nice = [os.getpriority(os.PRIO_PROCESS, pid) for pid in stats["stage_pids"]]
    assert [r[0] for r in results] == in_process
    assert stage_nice == [min(19, base_nice + 3)] * 2
    assert _max_steps_in_flight(engine.log_file) == expected_window
