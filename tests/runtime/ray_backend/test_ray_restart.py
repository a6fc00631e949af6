"""Ray stages restarted in place: a killed stage actor, then the node a stage ran on, are replaced while
16 requests stream (greedy and seeded, n-gram drafts on), and every request ends with the tokens of an
undisturbed run. The lost node's stage comes back on the simulated node left free; the stage pair still
hands off through NIXL."""

from __future__ import annotations

import json

import ray

from asyncpp.client import AsyncClient
from tests.runtime.conftest import wait_until
from tests.runtime.harness import launched, tiny_sections
from tests.runtime.ray_backend.conftest import NUM_NODES, placement_groups_alive, ray_sections
from tests.runtime.test_stage_restart import _events, _requests, _serve_all


def _placed(log_file) -> list[dict]:
    """Every `ray_stages_placed` record: the first start's, then one per restart."""
    return [e for e in _events(log_file) if e.get("event") == "ray_stages_placed"]


async def test_a_killed_actor_and_a_removed_node_are_replaced_and_every_request_finishes_exactly(
    tmp_path, tiny_hf_dir, ray_cluster
):
    sections = tiny_sections(
        tiny_hf_dir, 2, (2, 2),
        scheduler={"max_num_batched_tokens": 48},
        speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
        **ray_sections(ray_cluster, max_stage_restarts=3),
    )  # fmt: skip
    requests = _requests(json.loads((tiny_hf_dir / "config.json").read_text())["vocab_size"])
    try:
        with launched(tmp_path, sections) as engine:
            client = AsyncClient(engine.address)
            try:
                run_id = (await client.stats())["run_id"]
                expected = await _serve_all(client, requests)

                async def kill_actor() -> None:
                    ray.kill(ray.get_actor(f"asyncpp-{run_id}-stage1", namespace="asyncpp"))

                assert await _serve_all(client, requests, kill_actor) == expected, "actor killed"
                first, second = _placed(engine.log_file)
                lost_node = second["node_ids"][1]

                async def remove_node() -> None:
                    (node,) = [n for n in ray_cluster.worker_nodes if n.node_id == lost_node]
                    ray_cluster.remove_node(node)

                assert await _serve_all(client, requests, remove_node) == expected, "node removed"
                stats = await client.stats()
            finally:
                client.close()
        assert engine.proc.returncode == 0, "".join(engine.output[-40:])
        assert stats["stage_restarts"] == 2 and stats["num_recomputed_requests"] > 0
        placed = _placed(engine.log_file)
        assert [p["incarnation"] for p in placed] == [0, 1, 2]
        third = placed[2]
        assert lost_node not in third["node_ids"] and len(set(third["node_ids"])) == 2  # on the node left free
        assert all(p["transports"] == ["nixl"] for p in placed)
        assert sum(e.get("event") == "stage_recovered" for e in _events(engine.log_file)) == 2
        wait_until(lambda: not placement_groups_alive(), 10, "placement group removed")
    finally:
        while len(ray_cluster.worker_nodes) < NUM_NODES:  # give the session its node back
            ray_cluster.add_node(num_cpus=1)
        ray_cluster.wait_for_nodes()


def test_the_local_cluster_command_starts_its_nodes_prints_the_address_and_shuts_down(capsys):
    import threading

    from asyncpp.runtime.ray_backend.local_cluster import main as local_cluster

    calls = []

    class FakeCluster:  # ray.cluster_utils.Cluster's calls, recorded (the real one is the session's fixture)
        address = "10.0.0.5:61234"

        def __init__(self, **kwargs) -> None:
            calls.append(("init", kwargs))

        def add_node(self, **kwargs) -> None:
            calls.append(("add_node", kwargs))

        def wait_for_nodes(self) -> None:
            calls.append(("wait_for_nodes", {}))

        def shutdown(self) -> None:
            calls.append(("shutdown", {}))

    stop = threading.Event()
    stop.set()  # as SIGTERM would, once it serves
    assert local_cluster(["--nodes", "3", "--cpus-per-node", "2"], cluster_class=FakeCluster, stop=stop) == 0
    assert calls == [("init", {"initialize_head": True, "head_node_args": {"num_cpus": 0}}),
                     *[("add_node", {"num_cpus": 2})] * 3, ("wait_for_nodes", {}), ("shutdown", {})]  # fmt: skip
    assert capsys.readouterr().out == "ray cluster: 10.0.0.5:61234 (3 nodes of 2 CPUs)\n"
