"""Async output (`asyncpp.worker.async_output`): a step's sampled tokens stay on the device while the
next step, scheduled with placeholders, is enqueued; its placeholders are filled on the device.

On CPU the "device" is the CPU and the copy to the host is immediate, but the bookkeeping is the
same as on CUDA: which token is the latest per request, which rows the device fills, and the
order in which outputs are built. Tokens must equal the synchronous path's, through the runner
driven step by step, through a launched single stage with `scheduler.async_output = "on"`, and
in mixes where some steps cannot be deferred (logprobs, penalties, seeds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncpp.config import ConfigError
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.worker.async_output import AsyncSample, DeviceTokens
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect_all
from tests.runtime.harness import launched, tiny_sections

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_the_latest_record_wins():
    tokens = DeviceTokens()
    tokens.record(["a", "b"], [1, 2])
    first = AsyncSample(0, ["a", "b"], torch.tensor([10, 20]))
    tokens.add_pending(first)
    assert tokens.get("a", -1) == -1 and "a" in tokens.pending  # only on the device now
    second = AsyncSample(1, ["a"], torch.tensor([11]))
    tokens.add_pending(second)
    tokens.record(["b"], [21])  # b sampled synchronously after `first`
    tokens.resolve(first, first.token_ids())  # older than what a and b have: changes nothing
    assert tokens.pending["a"][0] is second and tokens.host["b"] == 21
    tokens.resolve(second, second.token_ids())
    assert tokens.host == {"a": 11, "b": 21} and not tokens.pending
    tokens.add_pending(AsyncSample(2, ["a"], torch.tensor([12])))
    tokens.forget("a")
    assert "a" not in tokens


def test_fill_on_device_writes_only_pending_rows():
    tokens = DeviceTokens()
    tokens.add_pending(AsyncSample(0, ["x", "y"], torch.tensor([7, 8])))
    tokens.record(["z"], [9])
    input_ids = torch.full((6,), -1, dtype=torch.int64)
    tokens.fill_on_device(input_ids, np.array([1, 3, 5]), ["y", "z", "x"])
    assert input_ids.tolist() == [-1, 8, -1, -1, -1, 7]  # z is the host's to write


def _drive(engine: Engine, prompts, params) -> tuple[dict[str, list[int]], int]:
    """Run `engine`'s single runner as a stage with async output does: enqueue the next step (with
    placeholders) before building the previous step's output. Returns the tokens by request and
    how many steps filled a placeholder on the device."""
    runner = engine.executor.runners[0]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    filled_on_device = 0
    held = None  # (plan, pending output)
    while engine.has_unfinished_requests() or held is not None:
        plan = engine.scheduler.schedule(after_step_id=held[0].step_id if held is not None else None)
        current = None
        if plan is not None:
            filled_on_device += bool(plan.after_step_id is not None and runner.sampled_token_ids.pending)
            runner.execute_model(plan)
            current = (plan, runner.sample_tokens_async())
        if held is not None:
            for out in engine.process_output(held[0], [held[1].get()]):
                tokens[out.request_id].extend(out.token_ids)
        held = current
    return tokens, filled_on_device


@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_runner_with_steps_held_gives_the_synchronous_tokens(tiny_hf_dir, kind):
    prompts = tiny_prompts(320, 6, seed=3)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    if kind == "mixed":  # steps with these rows are sampled synchronously; the others are held
        params[1] = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)
        params[2] = SamplingParams(max_tokens=5, temperature=0.8, seed=5, ignore_eos=True)
        params[4] = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    expected = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, params)]
    engine = Engine(tiny_config(tiny_hf_dir))
    tokens, filled_on_device = _drive(engine, prompts, params)
    assert list(tokens.values()) == expected
    assert filled_on_device > 5  # the path under test ran
    runner = engine.executor.runners[0]
    assert not runner.sampled_token_ids.pending  # every held step was resolved


def test_only_plain_draws_are_deferred(tiny_hf_dir):
    engine = Engine(tiny_config(tiny_hf_dir))
    runner = engine.executor.runners[0]
    engine.add_request(tiny_prompts(320, 1)[0], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1))
    plan = engine.scheduler.schedule()
    runner.execute_model(plan)
    assert not runner.can_defer()
    pending = runner.sample_tokens_async()
    assert not pending.is_deferred and pending.get().logprobs[0] is not None


def test_async_output_on_needs_one_stage_with_async_scheduling(tiny_hf_dir):
    with pytest.raises(ConfigError, match="scheduler.async_output"):
        tiny_config(tiny_hf_dir, parallel={"pp_size": 2}, scheduler={"async_output": "on"})
    with pytest.raises(ConfigError, match="scheduler.async_output"):
        tiny_config(tiny_hf_dir, scheduler={"async_output": "maybe"})
    assert not tiny_config(tiny_hf_dir).uses_async_output  # auto: CUDA only
    assert tiny_config(tiny_hf_dir, scheduler={"async_output": "on"}).uses_async_output


async def test_launched_stage_with_async_output_equals_in_process(tmp_path, tiny_hf_dir):
    prompts = tiny_prompts(320, 8, seed=4)
    params = GREEDY
    expected = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, params)]
    sections = tiny_sections(tiny_hf_dir, scheduler={"async_output": "on"})
    with launched(tmp_path, sections) as engine:
        results, _ = await collect_all(engine.address, prompts, params)
        # A request with logprobs among plain ones: its steps are sampled at once, the rest held.
        mixed, _ = await collect_all(
            engine.address, prompts[:2], SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
        )
    assert [r[0] for r in results] == expected
    assert [r[0] for r in mixed] == expected[:2]
