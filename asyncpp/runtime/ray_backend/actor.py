"""The Ray actor of one pipeline stage: where it runs, its receiving queues bound there, then the same
`stage_main` as a local stage.

`bind_inputs` binds the stage's receiving queues (activations; sampled tokens
on stage 0) on port 0 of the node's IP, with the run's token, and returns the
addresses the OS gave them; the actor keeps the queues and `run` hands them to
`stage_main`. A port is thus never picked free and bound later: from the
moment an address is reported, only the run's peers can connect to it.
"""

from __future__ import annotations

import os

import ray

from asyncpp.logging import configure_logging
from asyncpp.runtime.ray_backend.addresses import tcp
from asyncpp.runtime.stage_process import StageArgs, StageInputs, stage_main


class StageActor:
    def __init__(self) -> None:
        self._inputs: StageInputs | None = None

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP as Ray reports it, pid)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def bind_inputs(self, args: StageArgs, token: str) -> tuple[str, str]:
        """(activations address, sampled-tokens address) as bound, "" for a queue this stage lacks."""
        # Logging first: the token's refusal watcher, started by the first bind, keeps the logger it gets then.
        configure_logging(args.log_format, args.log_level, args.log_file)
        any_port = tcp(ray.util.get_node_ip_address(), 0)
        self._inputs = StageInputs.bind(args, any_port, any_port, token)
        return tuple(q.address if q is not None else "" for q in (self._inputs.acts_in, self._inputs.tokens_in))

    def run(self, args: StageArgs) -> None:
        """The stage loop, until `Shutdown` (returns) or a failure (raises: Ray reports it to the launcher)."""
        inputs, self._inputs = self._inputs, None  # the stage closes them
        stage_main(args, inputs)


def remote_stage_actor():
    """`StageActor` as a Ray actor class (made here so that importing this module needs no cluster)."""
    return ray.remote(max_restarts=0, max_task_retries=0)(StageActor)
