"""Greedy float32 output must not change with batching, chunking, preemption or layer split."""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import Sampler
from tests.conftest import tiny_config, tiny_prompts

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_hf_dir):
    return tiny_prompts(320, 10)


@pytest.fixture(scope="module")
def alone(tiny_hf_dir, prompts):
    """Each prompt run by itself: the reference."""
    engine = Engine(tiny_config(tiny_hf_dir))
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_continuous_batching_equals_alone(tiny_hf_dir, prompts, alone):
    engine = Engine(tiny_config(tiny_hf_dir))
    # Staggered arrivals: half now, the rest while the first half is decoding.
    ids = [engine.add_request(p, GREEDY) for p in prompts[:5]]
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    ids += [engine.add_request(p, GREEDY) for p in prompts[5:]]
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert [tokens[i] for i in ids] == alone


def test_chunked_prefill_equals_alone(tiny_hf_dir, prompts, alone):
    engine = Engine(tiny_config(tiny_hf_dir, scheduler={"max_num_batched_tokens": 8}))
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == alone


def test_preemption_equals_alone(tiny_hf_dir, prompts, alone):
    # 16 blocks of 16 tokens cannot hold 10 requests of up to 70 + 32 tokens at once.
    engine = Engine(tiny_config(tiny_hf_dir, cache={"num_kv_blocks_override": 16}))
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == alone
    assert engine.scheduler.stats().num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("pp_size,layer_split", [(2, (2, 2)), (2, (1, 3)), (3, (1, 2, 1)), (3, (2, 1, 1))])
def test_layer_split_gives_identical_logits(tiny_hf_dir, prompts, pp_size, layer_split, monkeypatch):
    def run(config) -> list[torch.Tensor]:
        captured = []
        original = Sampler.__call__

        def spy(self, logits, states):
            captured.append(logits.detach().clone())
            return original(self, logits, states)

        monkeypatch.setattr(Sampler, "__call__", spy)
        Engine(config).generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        monkeypatch.setattr(Sampler, "__call__", original)
        return captured

    whole = run(tiny_config(tiny_hf_dir))
    split = run(tiny_config(tiny_hf_dir, parallel={"pp_size": pp_size, "layer_split": layer_split}))
    assert len(whole) == len(split)
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


def test_prefix_cache_hits_and_same_output(tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir))
    prompt = prompts[4]  # 70 tokens: 4 full blocks of 16
    first = engine.generate([prompt], GREEDY)[0]
    hits_before = engine.block_manager.num_prefix_cache_hit_tokens
    second = engine.generate([prompt], GREEDY)[0]
    assert engine.block_manager.num_prefix_cache_hit_tokens - hits_before == 64
    assert second.num_cached_tokens == 64
    assert second.token_ids == first.token_ids


def test_prefix_cache_disabled_gives_no_hits(tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir, cache={"enable_prefix_caching": False}))
    prompt = prompts[4]
    a = engine.generate([prompt], GREEDY)[0]
    b = engine.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == 0 and a.token_ids == b.token_ids


@pytest.mark.parametrize("layer_split,shift", [((2, 2), 1), ((1, 3), 2), ((1, 2, 1), 1)])
def test_shifting_layer_bounds_give_identical_tokens(tiny_hf_dir, prompts, alone, layer_split, shift, monkeypatch):
    """Every step runs a different split within the windows (`parallel.shift_layers`): a layer's KV
    cache is written by one stage and read by the other, and the tokens stay the same."""
    config = tiny_config(tiny_hf_dir, parallel={"pp_size": len(layer_split), "layer_split": layer_split, "shift_layers": shift})
    engine = Engine(config)
    windows = engine.balancer.windows
    choices = list(itertools.product(*(range(lo, hi + 1) for lo, hi in windows)))
    assert len(choices) > 1
    schedule = itertools.cycle(choices[::-1] + choices[1:])
    monkeypatch.setattr(engine.balancer, "bounds", lambda plan: next(schedule))
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == alone
    held = [(r.model.start_layer, r.model.end_layer) for r in engine.executor.runners]
    assert held[0][0] == 0 and held[-1][1] == 4 and any(end > start for (_, end), (start, _) in zip(held, held[1:]))
    # The shared layers' caches are one tensor on both sides.
    lo, hi = windows[0]
    first, second = engine.executor.runners[:2]
    for layer in range(lo, hi):
        k0 = first.kv_caches[layer - first.model.start_layer][0]
        k1 = second.kv_caches[layer - second.model.start_layer][0]
        assert k0.data_ptr() == k1.data_ptr()


def test_bounds_outside_a_stage_fail_the_step(tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir, parallel={"pp_size": 2, "layer_split": (2, 2), "shift_layers": 1}))
    plan_bounds = iter([(0,)])  # stage 0 would run no layer
    engine.balancer.bounds = lambda plan: next(plan_bounds)
    failed = engine.generate(prompts[:1], GREEDY)[0]  # the step fails, as a stage process reports it
    assert failed.finish_reason == "error" and "cannot run on the slice" in failed.error
