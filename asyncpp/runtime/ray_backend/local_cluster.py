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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.runtime.ray_backend.local_cluster", description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes besides the head (default 2)")
    ap.add_argument("--cpus-per-node", type=int, default=1, help="CPUs each node offers (default 1)")
    ns = ap.parse_args(argv)
    if ns.nodes < 1 or ns.cpus_per_node < 1:
        ap.error("--nodes and --cpus-per-node must be >= 1")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    stop = threading.Event()
    try:
        for _ in range(ns.nodes):
            cluster.add_node(num_cpus=ns.cpus_per_node)
        cluster.wait_for_nodes()
        for sig in (signal.SIGINT, signal.SIGTERM):  # after the nodes: each start installs Ray's own
            signal.signal(sig, lambda *_: stop.set())
        print(f"ray cluster: {cluster.address} ({ns.nodes} nodes of {ns.cpus_per_node} CPUs)", flush=True)
        stop.wait()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
