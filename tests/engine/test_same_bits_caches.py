"""bfloat16, two stages: a row's logits are the same bits whether its prefix was computed in the step,
hit in the prefix cache, reloaded from the offload store, or recomputed after a preemption."""

from __future__ import annotations

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.kv_transfer.test_offload import FILLERS, FIRST, LATER
from tests.row_logits import RowRecorder, assert_rows_equal_single_rows

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BF16_PP2 = {"model": {"dtype": "bfloat16"}, "parallel": {"pp_size": 2, "layer_split": (1, 3)}}


def _engine(tiny_hf_dir, cache=None, **sections) -> Engine:
    return Engine(tiny_config(tiny_hf_dir, **BF16_PP2, cache={"block_size": 16, "kv_cache_memory_mb": 4, **(cache or {})}, **sections))


def _alone(tiny_hf_dir, recorder: RowRecorder, prompts) -> dict:
    """Each prompt in a fresh engine by itself, no cache: the reference rows."""
    for prompt in prompts:
        _engine(tiny_hf_dir, {"enable_prefix_caching": False}).generate([prompt], GREEDY)
    return recorder.take()


def test_prefix_cache_hits_give_the_same_bits(tiny_hf_dir, monkeypatch):
    recorder = RowRecorder(monkeypatch)
    shared = tiny_prompts(320, 5, seed=4)[4]  # 70 tokens: four whole blocks to share
    prompts = [shared + [5, 6, 7], shared + [9], shared[:40] + [11, 12]]
    reference = _alone(tiny_hf_dir, recorder, prompts)
    engine = _engine(tiny_hf_dir)
    engine.generate([prompts[0]], GREEDY)
    results = engine.generate(prompts, GREEDY)  # the first again, and two that share its prefix
    assert all(r.num_cached_tokens >= 32 for r in results)
    rows = recorder.take()  # the first prompt's rows twice, fresh and from the cache: the same bits
    assert rows.keys() == reference.keys() and len(rows) == len(prompts) * GREEDY.max_tokens
    assert_rows_equal_single_rows(rows, reference)


def test_offload_reloads_give_the_same_bits(tiny_hf_dir, monkeypatch):
    recorder = RowRecorder(monkeypatch)
    reference = _alone(tiny_hf_dir, recorder, [LATER])
    engine = _engine(tiny_hf_dir, {"num_kv_blocks_override": 20}, kv_transfer={"connector": "offload", "store_size_mb": 1})
    for prompt in (FIRST, *FILLERS):  # FIRST's prefix goes to the store, then out of the 20-block cache
        engine.generate([prompt], GREEDY)
    recorder.take()
    engine.generate([LATER], GREEDY)
    assert engine.kv_stats()["kv_blocks_loaded"] >= 8
    rows = recorder.take()
    assert rows.keys() == reference.keys()
    assert_rows_equal_single_rows(rows, reference)


def test_preemption_and_recompute_give_the_same_bits(tiny_hf_dir, monkeypatch):
    recorder = RowRecorder(monkeypatch)
    prompts = tiny_prompts(320, 10, seed=6)
    reference = _alone(tiny_hf_dir, recorder, prompts)
    engine = _engine(tiny_hf_dir, {"num_kv_blocks_override": 16})
    engine.generate(prompts, GREEDY)
    assert engine.scheduler.stats().num_preemptions > 0
    rows = recorder.take()  # a recompute that changed a row's bits fails here
    assert rows.keys() == reference.keys()
    assert_rows_equal_single_rows(rows, reference)
