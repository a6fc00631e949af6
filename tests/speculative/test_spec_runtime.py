"""Speculative decoding in the launched pipeline: greedy output through the client equals the
in-process engine without drafts at pp = 1, 2, 3, async scheduling on and off, with and without the
offload connector; the counters reach `client.stats()`."""

from __future__ import annotations

import json

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config
from tests.runtime.conftest import collect_all
from tests.runtime.harness import launched, tiny_sections
from tests.speculative.test_spec_engine import SPEC, repetitive_prompts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(320)


@pytest.fixture(scope="module")
def reference(tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir))
    try:
        return [r.token_ids for r in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()


def _drafted_steps(log_file) -> int:
    """Steps whose plan verified drafts, from the engine's debug events."""
    n = 0
    for line in log_file.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "step_dispatched" and event.get("num_drafts"):
            n += 1
    return n


@pytest.mark.parametrize(
    "pp_size,layer_split,async_scheduling,offload",
    [
        (1, (), False, False),
        (2, (2, 2), True, False),
        (2, (1, 3), False, False),
        (3, (1, 1, 2), True, False),
        (3, (2, 1, 1), False, False),
        (2, (2, 2), True, True),
        (1, (), True, True),
    ],
)
async def test_pipeline_with_drafts_equals_without(
    tmp_path, tiny_hf_dir, prompts, reference, pp_size, layer_split, async_scheduling, offload
):
    overrides = {"speculative": SPEC, "scheduler": {"async_scheduling": async_scheduling}}
    if offload:
        overrides["kv_transfer"] = {"connector": "offload", "store": "shm", "store_size_mb": 16}
    with launched(tmp_path, tiny_sections(tiny_hf_dir, pp_size, layer_split, **overrides)) as engine:
        results, stats = await collect_all(engine.address, prompts, GREEDY)
    assert [r[0] for r in results] == reference
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    assert _drafted_steps(engine.log_file) > 0
    if offload:
        assert stats["kv_blocks_saved"] > 0


async def test_verification_steps_on_the_static_buffer_path(tmp_path, tiny_hf_dir, prompts, reference):
    """Launched pp = 2 with async scheduling, stages on the CUDA-graph input path (static, padded buffers;
    captured as graphs only on CUDA): steps of a token and its drafts per request run from the buffers
    like decode steps of as many rows, and the tokens are those of plain decoding."""
    overrides = {"speculative": SPEC, "scheduler": {"async_scheduling": True}}
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), **overrides)
    with launched(tmp_path, sections, module="tests.runtime.static_buffers_launch") as engine:
        results, stats = await collect_all(engine.address, prompts[:2], GREEDY)
    assert [r[0] for r in results] == reference[:2]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    runs = [json.loads(line)["runs"] for line in engine.log_file.read_text().splitlines() if '"cuda_graph_runs"' in line]
    assert len(runs) == 2, runs  # one report per stage, at its close
    for stage_runs in runs:  # 2 requests: a step of more than 2 rows (sizes 4 and 8) carried drafts
        assert stage_runs["4"] + stage_runs["8"] > 0, stage_runs
