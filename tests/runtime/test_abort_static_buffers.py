"""An abort while decode steps run from static, padded buffers (the CUDA-graph path), launched pp=2.

An aborted request leaves the padded batch between two decode steps: the
next step is padded to a smaller size and the others' tokens must not
change. On CPU the stages get graph sizes through `static_buffers_launch`;
on CUDA (marked `cuda`) they capture real graphs.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect, is_idle, log_events, poll_until, wait_for_event
from tests.runtime.harness import launched, tiny_sections

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
LIVENESS_S = 60


@pytest.mark.parametrize(
    "device,module",
    [("cpu", "tests.runtime.static_buffers_launch"), pytest.param("cuda", "asyncpp.launch", marks=pytest.mark.cuda)],
)
async def test_abort_during_padded_decode_steps_leaves_the_others_exact(tmp_path, tiny_hf_dir, device, module):
    prompts = tiny_prompts(320, 3)  # 3, 17 and 9 tokens: 3 decoding requests, padded to 4
    expected = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts[1:], GREEDY)]
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), model={"device": device, "cuda_graph_sizes": [1, 2, 4, 8]})
    with launched(tmp_path, sections, module=module) as engine:
        client = AsyncClient(engine.address)
        try:
            others = [asyncio.create_task(collect(client, p, GREEDY)) for p in prompts[1:]]
            num_deltas = 0
            async for delta in client.generate(prompts[0], LONG, request_id="victim"):
                num_deltas += 1
                if num_deltas == 5:  # well into decoding, beside the others
                    break  # the client aborts it
            events = await wait_for_event(engine.log_file, "request_aborted", LIVENESS_S, request_id="victim")
            results = await asyncio.wait_for(asyncio.gather(*others), LIVENESS_S)
            stats = await poll_until(client.stats, is_idle, LIVENESS_S)
        finally:
            client.close()
    assert "request_finished" not in events
    assert [r[0] for r in results] == expected
    assert not stats["is_dead"]
    assert log_events(engine.log_file, event="stage_died") == []
    # Both stages really ran decode steps from static buffers (captured as graphs only on CUDA).
    assert log_events(engine.log_file, event="cuda_graphs_captured", sizes=[1, 2, 4, 8]) == ["cuda_graphs_captured"] * 2
