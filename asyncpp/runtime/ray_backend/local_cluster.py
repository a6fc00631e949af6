"""`python -m asyncpp.runtime.ray_backend.local_cluster`: a Ray cluster of simulated nodes on this machine.

A head without CPUs and `--nodes` nodes of `--cpus-per-node` CPUs each
(`ray.cluster_utils.Cluster`), the way the tests and the docs' Ray figures
run: every stage (one thread, one CPU) lands on a node of its own, and stage
pairs hand off through NIXL, over TCP when the launcher runs with
`UCX_TLS=tcp`. Prints `ray cluster: ADDRESS (N nodes of C CPUs)` once the
nodes are up (the address is `parallel.ray_address`), then serves until
Ctrl-C or SIGTERM and shuts the cluster down.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None, *, cluster_class=None, stop: threading.Event | None = None) -> int:
    """`cluster_class` and `stop`: for tests (a fake cluster; an event that ends the wait, instead of a signal)."""
    ap = argparse.ArgumentParser(prog="python -m asyncpp.runtime.ray_backend.local_cluster", description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes besides the head (default 2)")
    ap.add_argument("--cpus-per-node", type=int, default=1, help="CPUs each node offers (default 1)")
    ns = ap.parse_args(argv)
    if ns.nodes < 1 or ns.cpus_per_node < 1:
        ap.error("--nodes and --cpus-per-node must be >= 1")
    if cluster_class is None:
        from ray.cluster_utils import Cluster as cluster_class

    cluster = cluster_class(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(ns.nodes):
            cluster.add_node(num_cpus=ns.cpus_per_node)
        cluster.wait_for_nodes()
        if stop is None:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):  # after the nodes: each start installs Ray's own
                signal.signal(sig, lambda *_: stop.set())
        print(f"ray cluster: {cluster.address} ({ns.nodes} nodes of {ns.cpus_per_node} CPUs)", flush=True)
        stop.wait()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
