"""`parallel.shift_layers` across stage processes: shared KV segments, per-step bounds, same tokens."""

from __future__ import annotations

import glob
import json

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect_all
from tests.runtime.harness import launched, tiny_sections

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(320, 8)


async def test_shifted_pipeline_equals_in_process(tmp_path, tiny_hf_dir, prompts):
    expected = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]
    # Stage 0 has 1 layer of 4 and stage 1 also the head: any balance moves the boundary up.
    sections = tiny_sections(tiny_hf_dir, 2, (1, 3), parallel={"shift_layers": 2})
    with launched(tmp_path, sections) as engine:
        results, stats = await collect_all(engine.address, prompts, GREEDY)
        run_id = stats["run_id"]
        assert glob.glob(f"/dev/shm/asyncpp-{run_id}-kv0")  # the window's shared KV cache
    assert [r[0] for r in results] == expected
    balance = stats["layer_balance"]
    assert balance["num_observed_steps"] > 0
    assert sum(balance["bounds_counts"].values()) == stats["num_steps"]
    assert set(balance["bounds_counts"]) - {"1"}, balance  # some steps ran with another split
    ranges = [json.loads(line) for line in engine.log_file.read_text().splitlines() if '"engine_ready"' in line]
    assert ranges[0]["shift_windows"] == [[1, 3]]
    assert not glob.glob(f"/dev/shm/asyncpp-{run_id}-kv*")  # unlinked at exit
