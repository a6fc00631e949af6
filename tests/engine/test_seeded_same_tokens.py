"""Seeded sampling (temperature 1, top-p) gives the same tokens quiet, crowded among other requests and
across a preemption: bfloat16, two stages. Each draw comes from a stream indexed by (seed, position),
and the logits it reads do not depend on the batch."""

from __future__ import annotations

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts

SEEDS = (11, 2024, 77)
CROWD = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),  # unseeded: the global RNG
    SamplingParams(max_tokens=18, temperature=0.7, top_k=20, seed=5, ignore_eos=True),
]


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)


def _config(tiny_hf_dir, **cache):
    return tiny_config(tiny_hf_dir, model={"dtype": "bfloat16"}, parallel={"pp_size": 2}, cache=cache)


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(320, 12, seed=3)


@pytest.fixture(scope="module")
def quiet(tiny_hf_dir, prompts) -> list[list[int]]:
    """Each seeded request alone in the engine."""
    engine = Engine(_config(tiny_hf_dir))
    return [engine.generate([prompts[i]], seeded(seed))[0].token_ids for i, seed in enumerate(SEEDS)]


def _crowd(prompts) -> tuple[list, list[SamplingParams]]:
    """The seeded requests at positions 1, 5, 9 of twelve; the others greedy, unseeded or other seeds."""
    batch, params = [], []
    for i in range(12):
        if i % 4 == 1:
            batch.append(prompts[i // 4])
            params.append(seeded(SEEDS[i // 4]))
        else:
            batch.append(prompts[3 + i % 9])
            params.append(CROWD[i % len(CROWD)])
    return batch, params


def test_seeded_tokens_are_the_same_quiet_and_crowded(tiny_hf_dir, prompts, quiet):
    engine = Engine(_config(tiny_hf_dir))
    batch, params = _crowd(prompts)
    results = engine.generate(batch, params)
    assert [results[i].token_ids for i in (1, 5, 9)] == quiet
    assert len({tuple(t) for t in quiet}) == len(quiet)  # the seeds drew different streams


def test_seeded_tokens_are_the_same_across_a_preemption(tiny_hf_dir, prompts, quiet):
    # 16 blocks of 16 tokens cannot hold twelve requests of up to 70 + 30 tokens at once.
    engine = Engine(_config(tiny_hf_dir, num_kv_blocks_override=16))
    batch, params = _crowd(prompts)
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def record(request):
        preempted.append(request.request_id)
        preempt(request)

    engine.scheduler._preempt = record
    results = engine.generate(batch, params)
    assert {results[i].request_id for i in (1, 5, 9)} & set(preempted)  # a seeded request was recomputed
    assert [results[i].token_ids for i in (1, 5, 9)] == quiet
