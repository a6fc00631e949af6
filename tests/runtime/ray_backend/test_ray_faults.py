"""A stage actor killed, or its simulated node removed, mid-run, with restarts off: every stream ends with
EngineDeadError within 2 s, the launcher exits, and the placement group is gone (restarts:
`test_ray_restart.py`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from asyncpp.client import AsyncClient
from asyncpp.errors import EngineDeadError
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.runtime.conftest import wait_until
from tests.runtime.harness import launched, tiny_sections
from tests.runtime.ray_backend.conftest import placed_event, placement_groups_alive, ray_sections
from tests.runtime.test_stage_death import stream_until_failure

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
MAX_FAIL_S = 2.0


def _kill_actor(cluster, run_id: str, placed: dict) -> None:
    ray.kill(ray.get_actor(f"asyncpp-{run_id}-stage1", namespace="asyncpp"))


def _remove_node(cluster, run_id: str, placed: dict) -> None:
    node_id = placed["node_ids"][1]
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node)


@pytest.mark.parametrize("fault", [_kill_actor, _remove_node], ids=["actor_killed", "node_removed"])
async def test_a_lost_stage_fails_every_request_fast(tmp_path, tiny_hf_dir, ray_cluster, fault):
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), **ray_sections(ray_cluster, max_stage_restarts=0))
    prompts = [p[:40] for p in tiny_prompts(320, 6)]
    try:
        with launched(tmp_path, sections) as engine:
            placed = placed_event(engine.log_file)
            client = AsyncClient(engine.address)
            try:
                run_id = (await client.stats())["run_id"]
                first_token = asyncio.Event()
                tasks = [asyncio.create_task(stream_until_failure(client, p, first_token)) for p in prompts]
                await asyncio.wait_for(first_token.wait(), timeout=30)
                lost_at = time.monotonic()  # before the fault: removing a node takes a while itself
                fault(ray_cluster, run_id, placed)
                results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)
            finally:
                client.close()
            errors = [e for _, e, _ in results]
            assert all(isinstance(e, EngineDeadError) for e in errors), errors
            last_failure_s = max(ended for _, _, ended in results) - lost_at
            print(f"\n{fault.__name__}: last EngineDeadError {last_failure_s * 1e3:.0f} ms after the fault")
            assert last_failure_s < MAX_FAIL_S
            assert engine.wait(timeout_s=20) != 0
        assert "ray_stage_ended" in engine.log_file.read_text()
        wait_until(lambda: not placement_groups_alive(), 10, "placement group removed")
    finally:
        while len(ray_cluster.worker_nodes) < 3:  # give the session its node back
            ray_cluster.add_node(num_cpus=1)
        ray_cluster.wait_for_nodes()
