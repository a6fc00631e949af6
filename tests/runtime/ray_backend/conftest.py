"""A simulated Ray cluster for the session: a head with no CPUs and three 1-CPU nodes, so that every
stage (one thread, one CPU) lands on a node of its own and each stage pair hands off through NIXL,
over TCP (`UCX_TLS=tcp`, inherited by the launchers and the actors) even on this one machine."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("nixl_cu12")

from ray.cluster_utils import Cluster  # noqa: E402

NUM_NODES = 3


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("UCX_TLS", "tcp")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(NUM_NODES):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="asyncpp", logging_level="warning")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def ray_sections(cluster, **parallel) -> dict:
    return {"parallel": {"backend": "ray", "ray_address": cluster.address, **parallel}}


def placed_event(log_file) -> dict:
    """The launcher's `ray_stages_placed` log record (nodes, addresses, transports)."""
    import json

    for line in log_file.read_text().splitlines():
        if '"ray_stages_placed"' in line:
            return json.loads(line)
    raise AssertionError("no ray_stages_placed event in the log")


def placement_groups_alive() -> list[str]:
    """Names of the cluster's placement groups not removed (a finished run leaves none)."""
    from ray.util import placement_group_table

    return [pg["name"] for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
