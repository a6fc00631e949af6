"""Greedy float32 output must not change with batching, chunking, preemption or layer split."""

from __future__ import annotations

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
