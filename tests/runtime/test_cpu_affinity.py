"""Stage thread binding (`parallel.pin_threads`): the CPU lists, the environment, and a real pp=2 pipeline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncpp.client import AsyncClient
from asyncpp.config import EngineConfig, ModelConfig, ParallelConfig
from asyncpp.launch import stage_cpus
from asyncpp.runtime.cpu_affinity import affinity_env, stage_cpu_lists, usable_cpu_ids
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.runtime.conftest import collect


def test_each_stage_owns_its_cores_then_borrows_the_next_stages():
    assert stage_cpu_lists([0, 1], pp_size=2, num_threads=1) == [(0, 1), (1, 0)]
    assert stage_cpu_lists([0, 1, 2], pp_size=3, num_threads=1) == [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
    assert stage_cpu_lists([4, 5, 6, 7], pp_size=2, num_threads=2) == [(4, 5, 6, 7), (6, 7, 4, 5)]


def test_cpus_no_stage_owns_come_last():
    assert stage_cpu_lists([3, 1, 0, 2], pp_size=2, num_threads=1) == [(0, 1, 2, 3), (1, 0, 2, 3)]
    assert stage_cpu_lists([0, 1, 2, 3], pp_size=1, num_threads=2) == [(0, 1, 2, 3)]


def test_nothing_is_bound_without_a_core_per_stage_thread():
    assert stage_cpu_lists([0, 1], pp_size=3, num_threads=1) is None
    assert stage_cpu_lists([0, 1, 2], pp_size=2, num_threads=2) is None
    assert stage_cpu_lists([], pp_size=1, num_threads=1) is None


def test_affinity_env_leaves_the_users_binding_alone():
    assert affinity_env((1, 0), {}) == {"GOMP_CPU_AFFINITY": "1 0"}
    assert affinity_env((), {}) == {}
    for key in ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES"):
        assert affinity_env((1, 0), {key: "x"}) == {}


def test_launch_binds_cpu_stages_only_when_asked():
    cpus = usable_cpu_ids()
    pinned = stage_cpus(EngineConfig(parallel=ParallelConfig(pp_size=2, num_threads=1)), 2)
    assert pinned == (stage_cpu_lists(cpus, 2, 1) or [(), ()])
    off = EngineConfig(parallel=ParallelConfig(pp_size=2, num_threads=1, pin_threads=False))
    assert stage_cpus(off, 2) == [(), ()]
    gpu = EngineConfig(
        model=ModelConfig(device="cuda:0"), parallel=ParallelConfig(pp_size=2, num_threads=1, devices=("cuda:0", "cuda:1"))
    )
    assert stage_cpus(gpu, 2) == [(), ()]
    too_many = EngineConfig(parallel=ParallelConfig(pp_size=2, num_threads=len(cpus)))
    assert stage_cpus(too_many, 2) == [(), ()]


def _allowed_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of process `pid`: the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        spec = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
        cpus = set()
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        out[int(tid)] = cpus
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinity from /proc")
async def test_stage_threads_run_on_their_cpus(shared_pp2_engine):
    expected = stage_cpu_lists(usable_cpu_ids(), pp_size=2, num_threads=1)
    if expected is None or any(k in os.environ for k in ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")):
        pytest.skip("no core per stage thread here, or the environment sets its own binding")
    client = AsyncClient(shared_pp2_engine.address)
    try:
        # A lone request: its steps may borrow the other stage's core (a second, bound, worker thread).
        await collect(client, tiny_prompts(64, 1)[0], SamplingParams(max_tokens=8, temperature=0.0))
        stats = await client.stats()
    finally:
        client.close()
    for rank, pid in enumerate(stats["stage_pids"]):
        threads = _allowed_cpus(pid)
        assert threads[pid] == {expected[rank][0]}, f"stage {rank}'s main thread"
        # Every other thread is bound to one CPU of the list (a lent worker: the next stage's core).
        assert all(len(cpus) == 1 and cpus <= set(expected[rank]) for cpus in threads.values()), threads
