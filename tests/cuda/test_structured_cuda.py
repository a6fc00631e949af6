"""Structured outputs on CUDA stages (`cuda` mark): the grammar masks the logits on the last stage's
GPU; the tokens equal the CPU engine's (float32, TF32 off) and the text is in the grammar's language,
for pp = 1 and pp = 2 (the token ring between the stages)."""

from __future__ import annotations

import re

import pytest
import torch

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts

pytest.importorskip("llguidance")
pytestmark = pytest.mark.cuda

REGEX = r"(yes|no), [a-z]{2,6}( [a-z]{2,6}){0,3}\."
CHOICES = ["alpha", "beta", "gamma"]


def params() -> list[SamplingParams]:
    forms = [{"regex": REGEX}, {"choice": CHOICES}, {"json_object": True}]
    return [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=forms[i % 3]) for i in range(6)]


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def on_cpu(tiny_hf_dir):
    return Engine(tiny_config(tiny_hf_dir)).generate(tiny_prompts(323, 6), params())


@pytest.mark.parametrize("pp_size,split", [(1, ()), (2, (2, 2))])
def test_masked_greedy_on_the_gpu_equals_the_cpu(tiny_hf_dir, on_cpu, pp_size, split):
    config = tiny_config(tiny_hf_dir, model={"device": "cuda", "cuda_graph_sizes": (1, 2, 4, 8)},
                         parallel={"pp_size": pp_size, "layer_split": split})  # fmt: skip
    results = Engine(config).generate(tiny_prompts(323, 6), params())
    assert [r.token_ids for r in results] == [r.token_ids for r in on_cpu]
    assert re.fullmatch(REGEX, results[0].text) and results[1].text in CHOICES, (results[0].text, results[1].text)
