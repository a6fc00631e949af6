"""Steps run from static, padded buffers (the CUDA-graph path, without capture on CPU).

The graphs' input handling (padding to a captured size, the padding block,
the per-row block table and context lengths loaded into static buffers, a
non-first stage reading its own input buffer in-process) runs on CPU exactly
as on CUDA, only without `torch.cuda.graph`: greedy tokens must equal the
eager path's, and the padded sizes must really have been used, for decode
steps, verification steps and steps that carry prefill chunks.
"""

from __future__ import annotations

import pytest

from asyncpp.engine import engine as engine_module
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts

# Different lengths: requests finish one after another, so decode steps shrink from 11 to 1.
PARAMS = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(11)]
SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def prompts(tiny_hf_dir):
    return tiny_prompts(200, 11)


@pytest.fixture(scope="module")
def eager(tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir))
    return [r.token_ids for r in engine.generate(prompts, PARAMS)]


@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_static_decode_buffers_give_the_eager_tokens(tiny_hf_dir, prompts, eager, pp_size, monkeypatch):
    monkeypatch.setattr(engine_module, "step_graph_sizes", lambda config, device: SIZES)
    engine = Engine(tiny_config(tiny_hf_dir, parallel={"pp_size": pp_size}))
    runners = engine.executor.runners
    assert all(r.graphs is not None and not r.graphs.capture for r in runners)
    # 3 requests decode first (padded to 4), then 11 (eager, larger than 8), then fewer and fewer;
    # the prompts' steps are larger than 8 tokens: eager.
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], PARAMS)]
    tokens: dict[str, list[int]] = {}
    for _ in range(4):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    ids += [engine.add_request(p, sp) for p, sp in zip(prompts[3:], PARAMS[3:])]
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert [tokens[i] for i in ids] == eager
    for runner in runners:
        runs = runner.graphs.num_runs
        assert all(n > 0 for n in runs.values()), runs
    # Every stage runs the same steps the same way.
    assert len({tuple(r.graphs.num_runs.values()) for r in runners}) == 1


def test_padding_block_is_never_handed_out(tiny_hf_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "step_graph_sizes", lambda config, device: SIZES)
    engine = Engine(tiny_config(tiny_hf_dir, cache={"num_kv_blocks_override": 20}))
    runner = engine.executor.runners[0]
    assert engine.block_manager.num_blocks == 20
    assert runner.kv_caches[0][0].shape[0] == 21 * 16  # one more block: the padding rows' K/V
    assert runner.graphs.pad_slot == 20 * 16


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}


@pytest.mark.parametrize("pp_size", [1, 2])
def test_verification_steps_run_from_the_static_buffers(tiny_hf_dir, pp_size, monkeypatch):
    """With speculative decoding a request's step carries its last token and its drafts (1 + k rows);
    such a step runs from the static buffers like a decode step of as many requests, and the tokens
    stay those of plain eager decoding."""
    prompts = [p[:8] * 3 + p[8:] for p in tiny_prompts(320, 2, seed=1)]  # repeats: the proposer drafts
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, params)]
    monkeypatch.setattr(engine_module, "step_graph_sizes", lambda config, device: (1, 2, 4, 8, 16))
    engine = Engine(tiny_config(tiny_hf_dir, parallel={"pp_size": pp_size}, speculative=SPEC))
    assert [r.token_ids for r in engine.generate(prompts, params)] == plain
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for runner in engine.executor.runners:
        # Two requests: a step of more than 2 rows (sizes 4 to 16) carried drafts.
        runs = runner.graphs.num_runs
        assert runs[8] + runs[16] > 0, runs


MIXED_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_steps_with_prefill_chunks_run_from_the_static_buffers(tiny_hf_dir, prompts, eager, pp_size, monkeypatch):
    """Every step up to the largest size, prefill chunks and mixed prefill + decode steps included,
    runs from the buffers (a prompt token is a row like a decode at its position): no eager step."""
    monkeypatch.setattr(engine_module, "step_graph_sizes", lambda config, device: MIXED_SIZES)
    config = tiny_config(tiny_hf_dir, parallel={"pp_size": pp_size}, scheduler={"max_num_batched_tokens": 64})
    engine = Engine(config)
    runners = engine.executor.runners
    sizes_taken = []  # per step and stage: the size it was padded to, None for eager
    for runner in runners:
        padded_size = runner.graphs.padded_size
        runner.graphs.padded_size = lambda inputs, _f=padded_size: sizes_taken.append(_f(inputs)) or sizes_taken[-1]
    # Requests arrive while others decode: steps mix chunks of 64-token budgets with decodes.
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], PARAMS)]
    tokens: dict[str, list[int]] = {}
    for step in range(200):
        if step in (2, 5):
            first = 3 if step == 2 else 7
            ids += [engine.add_request(p, sp) for p, sp in zip(prompts[first : first + 4], PARAMS[first : first + 4])]
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert [tokens[i] for i in ids] == eager
    for runner in runners:
        runs = runner.graphs.num_runs
        assert runs[64] > 0 and runs[32] + runs[64] > 0, runs  # chunks of the 64-token budget, and mixes
    assert sizes_taken and None not in sizes_taken  # no step ran eagerly


def test_graph_sizes_reach_the_largest_step_not_the_number_of_requests():
    from asyncpp.config import EngineConfig, ModelConfig, SchedulerConfig
    from asyncpp.worker.stage import step_graph_sizes

    def sizes(max_num_batched_tokens: int, device: str = "cuda:0", **model) -> tuple[int, ...]:
        config = EngineConfig(
            model=ModelConfig(cuda_graph_sizes=(1, 2, 4, 256, 384, 512), **model),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=max_num_batched_tokens),
        )
        return step_graph_sizes(config, device)

    assert sizes(300) == (1, 2, 4, 256, 384)  # a 300-token step replays 384, though 2 requests run at most
    assert sizes(512) == (1, 2, 4, 256, 384, 512)
    assert sizes(4096) == (1, 2, 4, 256, 384, 512)  # larger steps run eagerly
    assert sizes(300, "cpu") == () and sizes(300, cuda_graphs=False) == ()
