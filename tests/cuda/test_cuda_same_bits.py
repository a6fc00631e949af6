"""The GPU path keeps the same rule as the CPU's: a bfloat16 model's logits reach the sampler in float32,
and moving the stage boundary (another split, another PP size) changes no bit, since what crosses it is
exactly what a stage carries between two of its layers. Compared per graph setting: graphs pad a step to
a captured size, and cuBLAS may pick another kernel for another row count."""

from __future__ import annotations

import pytest
import torch

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import Sampler
from tests.conftest import tiny_prompts
from tests.cuda.test_cuda_path import cuda_config

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SPLITS = [(1, ()), (2, (1, 3)), (2, (2, 2)), (2, (3, 1)), (3, (1, 2, 1)), (3, (2, 1, 1))]


def _logits(monkeypatch, config, prompts) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    original = Sampler.__call__

    def spy(sampler, logits, states):
        captured.append(logits.detach().cpu().clone())
        return original(sampler, logits, states)

    monkeypatch.setattr(Sampler, "__call__", spy)
    Engine(config).generate(prompts, GREEDY)
    monkeypatch.setattr(Sampler, "__call__", original)
    return captured


@pytest.mark.parametrize("graphs", [False, True])
def test_every_split_gives_float32_logits_bit_identical_to_one_stage(tiny_hf_dir, monkeypatch, graphs):
    prompts = tiny_prompts(320, 6)
    runs = {
        (pp_size, split): _logits(
            monkeypatch,
            cuda_config(tiny_hf_dir, graphs, model={"dtype": "bfloat16"}, parallel={"pp_size": pp_size, "layer_split": split}),
            prompts,
        )
        for pp_size, split in SPLITS
    }
    reference = runs[SPLITS[0]]
    assert reference and all(t.dtype == torch.float32 for t in reference)
    for key, logits in runs.items():
        assert len(logits) == len(reference), key
        assert all(torch.equal(a, b) for a, b in zip(reference, logits)), key
