"""Nothing the balancer or the machine decides changes a bit: every stage boundary of a pp=2 split
and of a pp=3 split, and every thread count this machine has, give logits bit-identical to pp=1 on
one thread, in bfloat16, for the tiny model and the real SmolLM2.

In process, one engine per split shape: `shift_layers` wide enough that each stage holds every layer
a boundary can reach, and the boundary forced per run (and, in one run, moved every step).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from asyncpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import Sampler
from tests.conftest import tiny_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
THREADS = range(1, len(os.sched_getaffinity(0)) + 1)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three colors."}],
]


def _config(model: ModelConfig, pp_size: int, shift_layers: int = 0) -> EngineConfig:
    return EngineConfig(
        model=model,
        parallel=ParallelConfig(pp_size=pp_size, num_threads=1, shift_layers=shift_layers),
        cache=CacheConfig(block_size=16, kv_cache_memory_mb=16, enable_prefix_caching=False),
    )


class LogitsRecorder:
    """The logits every sampler call of `engine` sees, per `generate`."""

    def __init__(self, monkeypatch) -> None:
        self.captured: list[torch.Tensor] = []
        original = Sampler.__call__

        def spy(sampler, logits, states):
            self.captured.append(logits.detach().clone())
            return original(sampler, logits, states)

        monkeypatch.setattr(Sampler, "__call__", spy)

    def run(self, engine: Engine, prompts, num_threads: int = 1) -> list[torch.Tensor]:
        self.captured = []
        before = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            engine.generate(prompts, GREEDY)
        finally:
            torch.set_num_threads(before)
        return self.captured


def _assert_same_bits(reference: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(reference), what
    for step, (a, b) in enumerate(zip(reference, got)):
        assert a.dtype == torch.float32, "logits reach the sampler in float32"
        assert torch.equal(a, b), f"{what}: step {step} differs by up to {float((a - b).abs().max())}"


def _every_split(model: ModelConfig, prompts, monkeypatch, every_pair: bool = True) -> None:
    """Every split, each with every thread count (`every_pair`), or with the thread counts taken in
    turn: every split and every thread count still run, in fewer engines."""

    def with_threads(splits) -> list:
        splits = list(splits)
        return list(itertools.product(splits, THREADS)) if every_pair else list(zip(splits, itertools.cycle(THREADS)))

    recorder = LogitsRecorder(monkeypatch)
    reference = recorder.run(Engine(_config(model, 1)), prompts)
    for threads in THREADS[1:]:
        _assert_same_bits(reference, recorder.run(Engine(_config(model, 1)), prompts, threads), f"pp=1, {threads} threads")
    wide = _config(model, 2, shift_layers=1000)
    pp2 = Engine(wide)
    (lo, hi), = pp2.balancer.windows
    assert (lo, hi) == (1, pp2.arch.num_layers - 1)  # every boundary a pp=2 split can have
    for bound, threads in with_threads(range(lo, hi + 1)):
        monkeypatch.setattr(pp2.balancer, "bounds", lambda plan, b=bound: (b,))
        _assert_same_bits(reference, recorder.run(pp2, prompts, threads), f"pp=2 from layer {bound}, {threads} threads")
    moving = itertools.cycle(range(hi, lo - 1, -3))
    monkeypatch.setattr(pp2.balancer, "bounds", lambda plan: (next(moving),))
    _assert_same_bits(reference, recorder.run(pp2, prompts), "pp=2, a boundary that moves every step")
    pp3 = Engine(_config(model, 3, shift_layers=1000))
    for bounds, threads in with_threads(_pp3_bounds(pp3.balancer.windows)):
        monkeypatch.setattr(pp3.balancer, "bounds", lambda plan, b=bounds: b)
        _assert_same_bits(reference, recorder.run(pp3, prompts, threads), f"pp=3 from layers {bounds}, {threads} threads")


def _pp3_bounds(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every start of stage 1 in its window, each with a start of stage 2 taken in turn from its own
    window (so every start of either is run), and the two extremes."""
    (lo1, hi1), (lo2, hi2) = windows
    seconds = itertools.cycle(range(lo2, hi2 + 1))
    return [(b1, next(seconds)) for b1 in range(lo1, hi1 + 1)] + [(lo1, hi2), (hi1, lo2)]


def test_tiny_model_bfloat16_every_split_and_thread_count(tiny_hf_dir, monkeypatch):
    model = ModelConfig(source="hf", path=str(tiny_hf_dir), dtype="bfloat16", max_model_len=256)
    _every_split(model, tiny_prompts(320, 6), monkeypatch)


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_bfloat16_every_split_and_thread_count(monkeypatch):
    _every_split(ModelConfig(source="gguf", dtype="bfloat16", max_model_len=512), CHATS, monkeypatch, every_pair=False)
