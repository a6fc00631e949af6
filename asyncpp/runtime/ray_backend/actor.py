"""The Ray actor of one pipeline stage: where it runs, free ports there, then the same `stage_main` as a local stage."""

from __future__ import annotations

import os

import ray

from asyncpp.runtime.ray_backend.addresses import free_ports
from asyncpp.runtime.stage_process import StageArgs, stage_main


class StageActor:
    def where(self) -> tuple[str, str, int]:
        """(node id, node IP as Ray reports it, pid)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_ports(self, count: int) -> list[int]:
        return free_ports(ray.util.get_node_ip_address(), count)

    def run(self, args: StageArgs) -> None:
        """The stage loop, until `Shutdown` (returns) or a failure (raises: Ray reports it to the launcher)."""
        stage_main(args)


def remote_stage_actor():
    """`StageActor` as a Ray actor class (made here so that importing this module needs no cluster)."""
    return ray.remote(max_restarts=0, max_task_retries=0)(StageActor)
