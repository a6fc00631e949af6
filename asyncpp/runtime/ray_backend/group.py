"""`RayStageGroup`: the engine's `StageGroup` with one Ray actor per stage instead of a child process.

Start-up (all before the first stage runs): connect to the cluster, reserve
the placement group, start the actors in their bundles, bind the engine's
queues on port 0 with a new token (one for every control connection), have
each actor learn its node and bind its receiving queues there the same way,
then build the run's `TcpAddresses` from the ports bound and choose each
stage pair's transport:
`nixl` when the two stages are on different nodes, the local one (shared
memory, CUDA IPC) when they share one. `start` hands each actor its
`StageArgs`; from then on the engine talks to the stages exactly as to local
ones. A stage's `run` call ending, normally or not (the actor killed, its
node gone), is a stage exit (`wait_for_death`). Whatever happens, `reap`
kills the actors and removes the placement group.

A restart (`asyncpp.runtime.recovery`): `kill_all` kills every actor and
closes the plan queues; `start_again` starts new actors in the same bundles
(Ray moves a lost node's bundle to a node with room, and the new actor waits
for it), binds new plan queues and inputs, and chooses the transports again
from where the actors landed. The placement group, the token and the
engine's output queue stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import time

from asyncpp.config import ConfigError, ParallelConfig
from asyncpp.kernels.isa import torch_isa_env
from asyncpp.logging import get_logger
from asyncpp.runtime.addresses import RunAddresses
from asyncpp.runtime.ray_backend.actor import remote_stage_actor
from asyncpp.runtime.ray_backend.addresses import TcpAddresses, new_token, tcp
from asyncpp.runtime.ray_backend.placement import Placement, connect, import_ray, reserve
from asyncpp.runtime.fault_hooks import INCARNATION_ENV
from asyncpp.runtime.stage_group import StageDiedError, StageGroup, openmp_env
from asyncpp.runtime.stage_process import StageArgs
from asyncpp.transport import transport_for
from asyncpp.wire.queues import AsyncPullQueue, AsyncPushQueue
from asyncpp.wire.stage_msgs import Shutdown

ACTOR_START_TIMEOUT_S = 120.0
REMOTE_TRANSPORT = "nixl"


@dataclasses.dataclass(frozen=True)
class ActorStage:
    """What the engine shows of a stage (`stats()["stage_pids"]`) and where it runs."""

    pid: int
    node_id: str
    node_ip: str


def stage_env(args: StageArgs, environ) -> dict[str, str]:
    """The actor's environment: the ISA cap and OpenMP spin a local stage gets, and the launcher's UCX settings."""
    env = (torch_isa_env(args.isa) if args.isa else {}) | openmp_env(args.device, environ)
    return env | {k: v for k, v in environ.items() if k.startswith("UCX_")}


def actor_name(run_id: str, rank: int, incarnation: int = 0) -> str:
    """A stage actor's name in the cluster; a restart's actors get new ones (a killed actor's name may
    stay taken a while)."""
    return f"asyncpp-{run_id}-stage{rank}" + (f"-r{incarnation}" if incarnation else "")


def pair_transport(node_ids: list[str], devices: list[str], rank: int) -> str:
    """The transport into stage `rank` (> 0): NIXL across nodes, the device's local one within a node."""
    return REMOTE_TRANSPORT if node_ids[rank] != node_ids[rank - 1] else transport_for(devices[rank])


class RayStageGroup(StageGroup):
    def __init__(self, stage_args: list[StageArgs], addresses: RunAddresses, parallel: ParallelConfig) -> None:
        # Not StageGroup.__init__: it spawns local processes. The attributes below are the same ones.
        self.pp_size = len(stage_args)
        self.readies = []
        self.addresses = addresses
        self.plan_queues, self.outputs, self.procs = [], None, []
        self.incarnation = 0
        self._started_with = None
        self._started_at, self.start_s = time.monotonic(), []
        self._log = get_logger(role="launch")
        self._placement: Placement | None = None
        self._actors: list = []
        self._runs: list = []  # concurrent futures of the actors' `run` calls
        self._ray = None
        self._first_args = stage_args  # before the actors' addresses and transports
        self._placement_name = parallel.placement
        try:
            connect(parallel.ray_address)
            ray = self._ray = import_ray()
            devices = [a.device for a in stage_args]
            self._placement = reserve(devices, parallel.num_threads, parallel.placement, f"asyncpp-{addresses.run_id}")
            # Every control socket is bound on port 0 before its address is known, token first: no port
            # is picked free and bound later, when another local user could have taken it.
            self._token = new_token()
            self._engine_ip = ray.util.get_node_ip_address()
            self.outputs = AsyncPullQueue(tcp(self._engine_ip, 0), bind=True, token=self._token)
            self._place()
        except BaseException:
            self.reap()
            raise

    def _place(self) -> None:
        """Start an actor per stage in its bundle, bind the plan queues and the actors' inputs, then
        build the run's addresses and each stage's args (transports from where the actors landed)."""
        ray, token = self._ray, self._token
        run_id = self.addresses.run_id
        actor_cls = remote_stage_actor()
        for rank, args in enumerate(self._first_args):
            bundle = self._placement.bundles[rank]
            env = stage_env(args, os.environ) | {INCARNATION_ENV: str(self.incarnation)}
            self._actors.append(
                actor_cls.options(
                    name=actor_name(run_id, rank, self.incarnation),
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0.0),
                    scheduling_strategy=self._placement.strategy(rank),
                    runtime_env={"env_vars": env},
                ).remote()
            )
        self.plan_queues = [AsyncPushQueue(tcp(self._engine_ip, 0), bind=True, token=token) for _ in range(self.pp_size)]
        try:
            wheres = ray.get([a.where.remote() for a in self._actors], timeout=ACTOR_START_TIMEOUT_S)
            inputs = ray.get(
                [a.bind_inputs.remote(args, token) for a, args in zip(self._actors, self._first_args)],
                timeout=ACTOR_START_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - an actor that cannot start (runtime env, import) stops the run
            raise ConfigError(f"parallel.backend = 'ray': the stage actors did not start: {e}") from e
        self.procs = [ActorStage(pid, node_id, ip) for node_id, ip, pid in wheres]
        self.addresses = TcpAddresses(
            run_id=run_id,
            run_dir=self.addresses.run_dir,
            token=token,
            plan_addrs=tuple(q.address for q in self.plan_queues),
            outputs_addr=self.outputs.address,
            # Stage 0 receives no activations; only stage 0 receives sampled tokens ("" when none pass).
            activation_addrs=("", *(acts for acts, _ in inputs[1:])),
            sampled_addr=inputs[0][1],
        )
        node_ids = [s.node_id for s in self.procs]
        devices = [a.device for a in self._first_args]
        self.stage_args = [
            dataclasses.replace(
                args,
                addresses=self.addresses,
                cpus=(),  # the launcher's CPU ids mean nothing on another host
                transport=pair_transport(node_ids, devices, rank) if rank > 0 else args.transport,
            )
            for rank, args in enumerate(self._first_args)
        ]
        self._log.info(
            "ray_stages_placed",
            node_ids=node_ids,
            node_ips=[s.node_ip for s in self.procs],
            plan_addrs=self.addresses.plan_addrs,
            outputs_addr=self.addresses.stage_outputs,
            activation_addrs=self.addresses.activation_addrs[1:],
            sampled_addr=self.addresses.sampled_tokens,
            transports=[a.transport for a in self.stage_args[1:]],
            placement=self._placement_name,
            engine_ip=self._engine_ip,
            incarnation=self.incarnation,
        )

    def start(self) -> None:
        self._started_at = time.monotonic()
        self._runs = [actor.run.remote(args).future() for actor, args in zip(self._actors, self.stage_args)]

    @property
    def supports_restart(self) -> bool:
        return True

    async def kill_all(self, timeout_s: float = 5.0) -> None:
        """Kill every actor and wait for its `run` call to end; unlink the rings left on this host; close
        the plan queues (a send still waiting on one fails with `StagesRestartedError`)."""
        for actor in self._actors:
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while not all(run.done() for run in self._runs) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._actors, self._runs = [], []
        self._unlink_rings()
        old_queues, self.plan_queues = self.plan_queues, []
        for q in old_queues:
            q.close()

    async def _new_stages(self) -> None:
        """New actors in the same bundles, their queues bound, not run yet; `StageDiedError` if they
        do not start (the supervisor counts it as a failed restart)."""
        try:
            await asyncio.to_thread(self._place)
        except ConfigError as e:
            raise StageDiedError(str(e)) from e

    def dead_stages(self) -> list[int]:
        return [rank for rank, run in enumerate(self._runs) if run.done()]

    async def wait_for_death(self) -> list[int]:
        """Ranks of the ended stages, as soon as any `run` call ends (Ray completes its future)."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def on_exit(_run) -> None:
            loop.call_soon_threadsafe(lambda: exited.done() or exited.set_result(None))

        for run in self._runs:
            run.add_done_callback(on_exit)
        await exited
        dead = self.dead_stages()
        for rank in dead:
            error = self._runs[rank].exception()
            self._log.error("ray_stage_ended", pp_rank=rank, node_id=self.procs[rank].node_id[:12],
                            error=f"{type(error).__name__}: {str(error)[:300]}" if error else None)  # fmt: skip
        return dead

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        if self.dead_stages():  # the survivors may be blocked on the dead one: no drain
            timeout_s = min(timeout_s, 0.5)
        dead = set(self.dead_stages())
        for rank, q in enumerate(self.plan_queues):
            if rank in dead:
                continue
            with contextlib.suppress(Exception):
                await asyncio.wait_for(q.put(Shutdown("engine stopping")), timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while not all(run.done() for run in self._runs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.reap()

    def reap(self) -> None:
        """Kill every actor, remove the placement group, unlink rings left on this host, close our sockets."""
        ray = self._ray
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self._placement is not None:
            with contextlib.suppress(Exception):
                self._placement.remove()
            self._placement = None
        self._unlink_rings()  # a killed stage on this host leaves its ring
        for q in [*self.plan_queues, self.outputs]:
            if q is not None:
                q.close()
        self.plan_queues, self.outputs = [], None
        shutil.rmtree(self.addresses.run_dir, ignore_errors=True)
        if ray is not None and ray.is_initialized():
            ray.shutdown()
