"""Lent threads through a real pp=2 pipeline: the stages run each step with the plan's threads, outputs unchanged.

The launcher runs with an idle-looking machine (`idle_machine_launch`): a
lone cohort is always lent every stage's threads, however busy the shared
machine running the tests is, so the check cannot turn itself off.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect, poll_until
from tests.runtime.harness import launched, tiny_sections

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PP_SIZE = 2


def _threads_by_step(log_file) -> tuple[dict[int, int], dict[int, list[int]]]:
    """The plan's `num_threads` per dispatched step, and the threads each stage ran it with."""
    planned, ran = {}, {}
    for line in log_file.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if event.get("event") == "step_dispatched":
            planned[event["step_id"]] = event["num_threads"]
        elif event.get("event") == "stage_done":
            ran.setdefault(event["step_id"], []).append(event["num_threads"])
    return planned, ran


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="lending needs two CPUs")
async def test_stages_run_with_the_plans_threads(tmp_path, tiny_hf_dir):
    prompts = tiny_prompts(320, 4)
    expected = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]
    sections = tiny_sections(tiny_hf_dir, PP_SIZE, (2, 2), scheduler={"async_scheduling": True})
    with launched(tmp_path, sections, module="tests.runtime.idle_machine_launch") as engine:
        client = AsyncClient(engine.address)
        try:
            alone = await collect(client, prompts[0], GREEDY)  # one cohort: lent threads
            lent = (await client.stats())["num_lent_steps"]
            together = await asyncio.gather(*(collect(client, p, GREEDY) for p in prompts))
        finally:
            client.close()
        # Every dispatched step's stage events, however late they reach the log.
        planned, ran = await poll_until(
            lambda: asyncio.to_thread(_threads_by_step, engine.log_file),
            lambda pr: pr[0] and all(len(pr[1].get(step_id, [])) == PP_SIZE for step_id in pr[0]),
            60,
        )
    assert alone[0] == expected[0]
    assert [r[0] for r in together] == expected
    assert lent >= GREEDY.max_tokens - 1  # the lone request's steps (its first one may be planned alone too)
    assert set(planned.values()) == {0, PP_SIZE}  # lent alone, not lent among four cohorts
    for step_id, num_threads in planned.items():
        assert ran[step_id] == [num_threads or 1] * PP_SIZE, step_id
