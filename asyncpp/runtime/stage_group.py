"""`StageGroup`: spawn the stage processes, collect ready-acks and handshakes, reap them, clean up.

Owns the child processes and the names of their shared-memory rings, so that
whatever happens (Ctrl-C, a stage killed with SIGKILL) every child is reaped
and every segment unlinked, torch's own included (`unlink_torch_shm`). A
stage whose ISA level is below the CPU's best starts with
`torch_isa_env(level)` in its environment (torch reads it when the child
imports it), set around that child's start only. CPU stages also
start with a short OpenMP spin (`openmp_env`) unless the user chose one, and
with their threads bound to their CPUs (`StageArgs.cpus`, `cpu_affinity`)
unless the user chose a binding.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import zmq

from asyncpp.kernels.isa import torch_isa_env
from asyncpp.kv_transfer.handshake import KVHandshakeMetadata, aggregate_handshakes
from asyncpp.runtime.addresses import RunAddresses
from asyncpp.runtime.cpu_affinity import affinity_env
from asyncpp.runtime.fault_hooks import INCARNATION_ENV
from asyncpp.runtime.stage_process import StageArgs, stage_main
from asyncpp.wire.codec import encode
from asyncpp.wire.loop_socket import SocketClosedError
from asyncpp.wire.queues import AsyncPullQueue, AsyncPushQueue
from asyncpp.wire.stage_msgs import Shutdown, StageHandshake, StageReady, StageStart
from asyncpp.worker.shared_kv import SharedKVSpec

# Spins libgomp's idle workers make before they sleep (default 300000: milliseconds). A stage
# that ran a step with lent threads (a lone cohort) would otherwise keep spinning on the core
# the next stage computes on; a short spin still bridges the gaps between one step's kernels.
# Measured on 2 cores, one request, lent threads: 1000 gave 8.2-8.7 ms per token; 0 (a futex
# wake per kernel) 14-15; 300 10-11; 10000 8.5-10; 100000 and the default 10-11.7.
STAGE_GOMP_SPINCOUNT = "1000"


class StageDiedError(RuntimeError):
    pass


class StagesRestartedError(RuntimeError):
    """A message for the stages a restart replaced: it never reached them."""


class StageGroup:
    def __init__(self, stage_args: list[StageArgs], addresses: RunAddresses) -> None:
        self.stage_args = stage_args
        self.addresses = addresses
        self.pp_size = len(stage_args)
        # The engine binds its ends first so stages can connect in any order.
        self.plan_queues = [AsyncPushQueue(addresses.plan(a.pp_rank), bind=True) for a in stage_args]
        self.outputs = AsyncPullQueue(addresses.stage_outputs, bind=True)
        self.procs = self._new_procs()
        self.readies: list[StageReady] = []
        self.incarnation = 0  # restarts so far (`start_again`); each stage sees it as ASYNCPP_STAGE_INCARNATION
        self._started_with: tuple[int, list[SharedKVSpec]] | None = None  # `start_stages`' arguments
        self._started_at = 0.0
        self.start_s: list[float] = []  # each start (the first, then every restart): processes -> handshakes

    def _new_procs(self) -> list:
        ctx = mp.get_context("spawn")
        return [ctx.Process(target=stage_main, args=(a,), name=f"asyncpp-stage-{a.pp_rank}") for a in self.stage_args]

    def start(self) -> None:
        self._started_at = time.monotonic()
        for args, p in zip(self.stage_args, self.procs):
            env = torch_isa_env(args.isa) if args.isa else {}
            env = env | openmp_env(args.device, os.environ) | affinity_env(args.cpus, os.environ)
            with _environ(env | {INCARNATION_ENV: str(self.incarnation)}):
                p.start()

    @property
    def supports_restart(self) -> bool:
        return True

    async def kill_all(self, timeout_s: float = 5.0) -> None:
        """The first half of a restart: kill every stage process (a survivor may be blocked for good
        on a lost stage's ring or queue) and reap it, remove the rings and torch files, and replace
        the plan queues by new ones on the same addresses. A send still waiting on an old queue (its
        stage died before taking the plan) fails with `StagesRestartedError` instead of handing a
        new stage a stale plan. The engine's output queue stays bound."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
        deadline = time.monotonic() + timeout_s
        while any(p.pid is not None and p.exitcode is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self._reap_procs()
        self._unlink_rings()
        old_queues, self.plan_queues = self.plan_queues, []
        for q in old_queues:
            q.close()
        self.plan_queues = [AsyncPushQueue(self.addresses.plan(a.pp_rank), bind=True) for a in self.stage_args]

    async def start_again(self, timeout_s: float) -> dict[tuple[int, int], KVHandshakeMetadata] | None:
        """The second half: new processes with the same `StageArgs` (layers, device, transport,
        CPUs), taken through start-up again: ready-acks, the `StageStart` the first ones got,
        handshakes (returned; None if the first stages were never started). Raises like
        `wait_ready` when a new stage dies or is late."""
        self.incarnation += 1
        await self._new_stages()
        self.start()
        await self.wait_ready(timeout_s)
        if self._started_with is None:
            return None
        await self.start_stages(*self._started_with)
        return await self.wait_handshakes(timeout_s)

    async def _new_stages(self) -> None:
        """The processes a restart starts (not started yet)."""
        self.procs = self._new_procs()

    def dead_stages(self) -> list[int]:
        return [rank for rank, p in enumerate(self.procs) if p.exitcode is not None]

    async def wait_for_death(self) -> list[int]:
        """Ranks of the dead stages, as soon as any stage exits; no polling while they all live.

        A process's sentinel (a pipe only the child holds open) turns readable
        when it exits, a moment before the parent can reap it: then poll briefly.
        """
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        for p in self.procs:
            loop.add_reader(p.sentinel, on_exit)
        try:
            await exited
        finally:
            for p in self.procs:
                loop.remove_reader(p.sentinel)
        while not (dead := self.dead_stages()):
            await asyncio.sleep(0.005)
        return dead

    async def wait_ready(self, timeout_s: float) -> list[StageReady]:
        """Collect one `StageReady` per stage; raise if a stage dies or time runs out."""
        readies = {msg.pp_rank: msg for msg in await self._collect(StageReady, timeout_s, "ready")}
        self.readies = [readies[r] for r in range(self.pp_size)]
        return self.readies

    async def wait_handshakes(self, timeout_s: float) -> dict[tuple[int, int], KVHandshakeMetadata]:
        """Collect one `StageHandshake` per stage (sent once its runner is built, after
        `start_stages`): the published metadata by `(pp_rank, tp_rank)`; raise like `wait_ready`."""
        msgs = await self._collect(StageHandshake, timeout_s, "built")
        self.start_s.append(time.monotonic() - self._started_at)
        return aggregate_handshakes((msg.pp_rank, msg.tp_rank, msg.metadata) for msg in msgs)

    async def _collect(self, cls: type, timeout_s: float, what: str) -> list:
        """Start-up messages of type `cls` until every stage sent one. Other messages are dropped:
        no plan has been sent yet, so there is no `StageOutput` to lose."""
        msgs, ranks = [], set()
        deadline = time.monotonic() + timeout_s
        while len(ranks) < self.pp_size:
            if self.dead_stages():
                raise StageDiedError(f"stage(s) {self.dead_stages()} died during start-up")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"stages {sorted(set(range(self.pp_size)) - ranks)} not {what} within {timeout_s} s")
            try:
                msg = await asyncio.wait_for(self.outputs.get(), timeout=min(remaining, 0.2))
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, cls):
                msgs.append(msg)
                ranks.add(msg.pp_rank)
        return msgs

    async def start_stages(self, num_kv_blocks: int, shared_kv: list[SharedKVSpec] | None = None) -> None:
        self._started_with = (num_kv_blocks, list(shared_kv or []))
        for rank, q in enumerate(self.plan_queues):
            send_ring = self.readies[rank + 1].recv_ring if rank + 1 < self.pp_size else None
            token_ring = self.readies[0].token_ring if rank == self.pp_size - 1 else None
            await q.put(StageStart(num_kv_blocks, send_ring, list(shared_kv or []), token_ring))

    async def broadcast(self, msg) -> None:
        """Send `msg` to every stage; `StagesRestartedError` if a restart replaced them meanwhile
        (a send to a dead stage waits until a restart closes its queue)."""
        frame = encode(msg)  # once for every stage: plans are the engine's hottest encode
        queues = self.plan_queues
        try:
            for q in queues:
                await q.put_encoded(frame)
        except (SocketClosedError, zmq.ZMQError) as e:
            if queues is self.plan_queues:
                raise
            raise StagesRestartedError("the stages were replaced while a message was sent to them") from e

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        # After a stage died, the survivors may be blocked forever on it (waiting for its
        # activations, or pushing to its ring with no reader): do not wait for a drain.
        if self.dead_stages():
            timeout_s = min(timeout_s, 0.5)
        for rank, q in enumerate(self.plan_queues):
            # A PUSH socket whose reader is gone (or never connected) blocks its send
            # forever, so a dead stage gets nothing and every send is bounded.
            if self.procs[rank].exitcode is not None:
                continue
            try:
                await asyncio.wait_for(q.put(Shutdown("engine stopping")), timeout=0.5)
            except Exception:  # noqa: BLE001 - best effort; we terminate below anyway
                pass
        deadline = time.monotonic() + timeout_s
        while any(p.exitcode is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.reap()

    def reap(self) -> None:
        """Terminate, then kill, whatever still runs; unlink every ring and torch file; remove the run dir."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                p.terminate()
        self._reap_procs()
        self._unlink_rings()
        for q in self.plan_queues:
            q.close()
        self.outputs.close()
        shutil.rmtree(self.addresses.run_dir, ignore_errors=True)

    def _reap_procs(self) -> None:
        """Join every started process (killing what still runs after 2 s) and remove its torch files."""
        for p in self.procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=2.0)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=2.0)
            unlink_torch_shm(p.pid)

    def _unlink_rings(self) -> None:
        for name in self.addresses.ring_names(self.pp_size):
            try:
                seg = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:
                continue
            seg.close()
            seg.unlink()


def unlink_torch_shm(pid: int, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the shared-memory files torch made in the (dead) process `pid`; their names.

    Sharing CUDA memory (the CUDA IPC ring's `_share_cuda_`) makes torch keep a
    reference counter in `/dev/shm/torch_<pid>_<random>_<n>`, which only the
    last process to close it unlinks: a stage that exits, or is killed, with
    the ring still open leaves it behind. The CUDA driver, too, keeps the
    interprocess events a process made (the ring's `written` / `released`) in
    `/dev/shm/cuda.shm.<n>.<pid in hex>.<n>`, and a stage left one behind in
    every pp = 2 run on an H200 (2026-11-26), stopped cleanly or not. Call
    this once `pid` has been reaped.
    """
    removed = []
    for pattern in (f"torch_{pid}_*", f"cuda.shm.*.{pid:x}.*"):
        for path in shm_dir.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed


def openmp_env(device: str, environ) -> dict[str, str]:
    """What a stage on `device` adds to its environment for OpenMP; none where the user set the policy."""
    if device != "cpu" or "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": STAGE_GOMP_SPINCOUNT}


@contextlib.contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """`updates` in os.environ for the block, then the previous values back.

    A spawned child is exec'd with the parent's environment as it is at
    `Process.start()`, so this sets the child's environment and no one else's.
    """
    previous = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
