"""The offload connector on CUDA caches, end to end (`cuda` mark: skipped without a GPU).

An evicted prefix comes back from every stage's host store into the GPU
cache, token for token the same as without a connector, in-process (pp 1, 2,
CUDA graphs on) and launched (pp 2, CUDA IPC between stages); every save is
stored (none fails, none is dropped), and afterwards nothing is pending.
"""

from __future__ import annotations

import pytest
import torch

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config
from tests.kv_transfer.test_offload_runtime import serve_prefix_twice
from tests.runtime.harness import launched, tiny_sections

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 16
PREFIX = [(7 * i + 3) % 300 + 3 for i in range(10 * BLOCK)]
FIRST, LATER = PREFIX + list(range(40, 60)), PREFIX + list(range(200, 230))
FILLERS = [[(11 * i + k) % 290 + 5 for i in range(200)] for k in (1, 2)]
SPLITS = {1: (), 2: (1, 3)}


def cuda_engine(tiny_hf_dir, pp_size: int, kv: dict | None = None) -> Engine:
    return Engine(
        tiny_config(
            tiny_hf_dir,
            model={"device": "cuda", "cuda_graph_sizes": (1, 2, 4, 8)},
            parallel={"pp_size": pp_size, "layer_split": SPLITS[pp_size]},
            cache={"num_kv_blocks_override": 20},
            **({"kv_transfer": kv} if kv else {}),
        )
    )


def run(e: Engine, prompt: list[int]) -> list[int]:
    return e.generate([prompt], GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def expected(tiny_hf_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    return run(cuda_engine(tiny_hf_dir, 1), LATER)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_an_evicted_prefix_comes_back_into_a_cuda_cache(tiny_hf_dir, expected, pp_size):
    e = cuda_engine(tiny_hf_dir, pp_size, {"connector": "offload", "store_size_mb": 1})
    run(e, FIRST)
    for filler in FILLERS:
        run(e, filler)
    before = e.scheduler.stats()
    assert run(e, LATER) == expected
    after = e.scheduler.stats()
    assert after.num_external_prefix_hit_tokens - before.num_external_prefix_hit_tokens > 0
    assert after.num_failed_load_tokens == 0  # every block saved from the GPU loaded back intact
    stats = e.kv_stats()
    assert stats["kv_blocks_saved"] > 0 and stats["kv_blocks_loaded"] > 0
    assert stats["kv_store_pending_blocks"] == 0 and stats["kv_store_pinned_blocks"] == 0
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    e.close()


async def test_launched_pp2_offload_from_cuda_stages_is_token_exact(tmp_path, tiny_hf_dir, expected):
    sections = tiny_sections(
        tiny_hf_dir, 2, (1, 3),
        model={"device": "cuda", "cuda_graph_sizes": [1, 2, 4, 8]},
        cache={"num_kv_blocks_override": 20},
        kv_transfer={"connector": "offload", "store_size_mb": 2},
    )  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with launched(tmp_path, sections) as engine:
        tokens, before, after = await serve_prefix_twice(engine, FIRST, FILLERS, LATER, params)
    assert tokens == expected
    assert after["num_external_prefix_hit_tokens"] > before["num_external_prefix_hit_tokens"]
    assert after["num_failed_load_tokens"] == 0 and after["kv_blocks_saved"] > 0
    assert after["kv_store_pending_blocks"] == 0
