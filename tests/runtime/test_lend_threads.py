"""Thread lending: which plans the engine server lends every stage's threads to, without processes.

The server runs on a fake stage group that records the plans it broadcasts and a
real scheduler; steps are completed by hand, in step order, as the stages would.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from asyncpp.config import EngineConfig, ModelConfig, ParallelConfig
from asyncpp.core.plan import StepPlan
from asyncpp.core.request import Request
from asyncpp.core.scheduler import Scheduler
from asyncpp.kv.block_manager import BlockManager
from asyncpp.runtime.engine_server import EngineServer
from asyncpp.runtime.step_window import StepWindow
from asyncpp.runtime.spare_cpus import SpareCpus
from asyncpp.runtime.stage_group import STAGE_GOMP_SPINCOUNT, openmp_env
from asyncpp.sampling.params import SamplingParams


class FakeStages:
    def __init__(self, pp_size: int) -> None:
        self.pp_size = pp_size
        self.procs: list = []
        self.plans: list[StepPlan] = []

    async def broadcast(self, plan: StepPlan) -> None:
        self.plans.append(plan)


def _server(pp_size: int = 2, num_threads: int = 1, num_spare_cpus: float = 64.0, **parallel) -> StepWindow:
    config = EngineConfig(parallel=ParallelConfig(pp_size=pp_size, num_threads=num_threads, **parallel))
    scheduler = Scheduler(
        BlockManager(64, 4), max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64, async_scheduling=True
    )
    core = SimpleNamespace(config=config, scheduler=scheduler, kv_connector=None)
    server = EngineServer(core, FakeStages(pp_size), router=None, async_scheduling=True).window
    if server.spare_cpus is not None:  # the machine running the tests is no idle pipeline
        server.spare_cpus = SimpleNamespace(refresh=lambda now: num_spare_cpus, track=lambda pids: None)
    return server


def _add(server: StepWindow, request_id: str, max_tokens: int = 8) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    server.core.scheduler.add_request(Request(request_id, [5, 6, 7], params))


def _dispatch(server: StepWindow) -> list[StepPlan]:
    """The plans one fill of the window sends."""
    num_before = len(server.stages.plans)
    asyncio.run(server._dispatch())
    return server.stages.plans[num_before:]


def _complete(server: StepWindow, plan: StepPlan) -> None:
    sampled = {s.request_id: [9] for s in plan.scheduled if s.do_sample}
    server.core.scheduler.update_from_output(plan, sampled)
    del server.in_flight[plan.step_id]
    server._retire(plan.step_id)


def test_a_lone_request_runs_with_every_stages_threads():
    server = _server(pp_size=2, num_threads=1)
    _add(server, "a")
    plans = _dispatch(server)
    assert len(plans) == 2  # async scheduling: the cohort's next step goes out at once
    assert [p.num_threads for p in plans] == [2, 2]
    _complete(server, plans[0])
    assert [p.num_threads for p in _dispatch(server)] == [2]
    assert server.num_lent_steps == 3


def test_a_second_cohort_takes_the_threads_back_until_it_ends():
    server = _server(pp_size=2, num_threads=2)
    _add(server, "a")
    first, second = _dispatch(server)
    assert first.num_threads == second.num_threads == 4
    _add(server, "b", max_tokens=1)  # arrives while a's lent steps run: they keep their threads
    (b_plan,) = _dispatch(server)
    assert len(server.cohorts) == 2 and b_plan.num_threads == 0
    _complete(server, first)
    (a_next,) = _dispatch(server)
    assert a_next.num_threads == 0  # two cohorts in flight
    _complete(server, second)
    _complete(server, b_plan)  # b is done: its cohort ends
    (a_alone,) = _dispatch(server)
    assert len(server.cohorts) == 1 and a_alone.num_threads == 4


def test_requests_arriving_together_run_with_their_own_threads():
    server = _server(pp_size=2, num_threads=1)
    for request_id in "abcd":
        _add(server, request_id)
    plans = _dispatch(server)
    # The first plan goes out before the second cohort exists: it alone may borrow.
    assert len(plans) == 4 and [p.num_threads for p in plans[1:]] == [0, 0, 0]


@pytest.mark.parametrize(
    "config",
    [
        {"lend_idle_threads": False},
        {"pp_size": 1},  # nobody to borrow from
    ],
)
def test_no_lending(config):
    server = _server(**{"pp_size": 2, **config})
    _add(server, "a")
    assert [p.num_threads for p in _dispatch(server)] == [0, 0]
    assert server.num_lent_steps == 0 and server.spare_cpus is None


def test_no_lending_to_cuda_stages():
    config = EngineConfig(model=ModelConfig(device="cuda"), parallel=ParallelConfig(pp_size=2))
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64)
    core = SimpleNamespace(config=config, scheduler=scheduler, kv_connector=None)
    assert EngineServer(core, FakeStages(2), router=None).window.max_lent_threads == 0


@pytest.mark.parametrize(
    "pp_size,num_spare_cpus,expected",
    [
        (2, 2.0, 2),
        (2, 1.8, 2),  # others' noise
        (2, 1.5, 0),  # a core half taken: a lent thread would wait for it in every kernel
        (2, 0.7, 0),
        (4, 2.0, 2),  # 4 stages on 2 free cores: 2 threads, not 4
        (4, 3.9, 4),
    ],
)
def test_lends_only_spare_cores(pp_size, num_spare_cpus, expected):
    server = _server(pp_size=pp_size, num_threads=1, num_spare_cpus=num_spare_cpus)
    _add(server, "a")
    assert {p.num_threads for p in _dispatch(server)} == {expected}


def test_spare_cpus_subtract_what_others_take(monkeypatch):
    # (monotonic s, busy CPU s of our CPUs, CPU s of our processes)
    readings = iter([(0.0, 10.0, 4.0), (1.0, 11.5, 4.5), (2.0, 13.5, 6.5), None, (4.0, 20.0, 10.0)])
    monkeypatch.setattr(SpareCpus, "_read", lambda self: next(readings))
    spare = SpareCpus([1], interval_s=0.5)
    num_cpus = len(spare.cpu_ids)
    now = time.monotonic() + 1
    assert spare.refresh(now) == num_cpus - 1.0  # others took 1.5 - 0.5 CPU s in 1 s
    assert spare.refresh(now + 0.1) == num_cpus - 1.0  # not read again within the interval
    assert spare.refresh(now + 0.6) == num_cpus  # all the busy time was ours
    assert spare.refresh(now + 1.2) == num_cpus  # no reading: the last value stays
    assert spare.refresh(now + 1.8) == num_cpus  # ... and the next one starts afresh


def test_spare_cpus_read_this_machine():
    """The /proc reading itself, against independent sources: our CPU time from `os.times`, the
    CPUs' busy time from psutil, each read just before and just after it (the counters only grow)."""
    import os

    psutil = pytest.importorskip("psutil")

    def busy_s(cpu_ids) -> float:
        per_cpu = psutil.cpu_times(percpu=True)
        return sum(
            t.user + t.nice + t.system + t.irq + t.softirq + t.steal for i, t in enumerate(per_cpu) if i in cpu_ids
        )

    def ours_s() -> float:
        t = os.times()
        return t.user + t.system

    spare = SpareCpus([os.getpid()], interval_s=0.0)
    cpu_ids = set(spare.cpu_ids)
    assert cpu_ids == os.sched_getaffinity(0)
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
    sum(i * i for i in range(300_000))  # some CPU time of our own, user and system
    busy_before, ours_before = busy_s(cpu_ids), ours_s()
    _, busy, ours = spare._read()
    busy_after, ours_after = busy_s(cpu_ids), ours_s()
    assert ours_before > 0.0 and ours_before - tick_s <= ours <= ours_after + tick_s
    assert busy_before - tick_s <= busy <= busy_after + tick_s
    assert spare.refresh(time.monotonic()) <= len(cpu_ids)
    assert SpareCpus([os.getpid(), 2**22 + 1], interval_s=0.0)._read()[2] >= ours  # a gone pid counts 0


def test_openmp_env_keeps_what_the_user_chose():
    assert openmp_env("cpu", {}) == {"GOMP_SPINCOUNT": STAGE_GOMP_SPINCOUNT}
    assert openmp_env("cpu", {"GOMP_SPINCOUNT": "300000"}) == {}
    assert openmp_env("cpu", {"OMP_WAIT_POLICY": "active"}) == {}
    assert openmp_env("cuda:0", {}) == {}


@pytest.mark.parametrize("has_loads", [True, False])
def test_idle_polls_for_transfers_come_fast_only_when_a_request_waits(has_loads):
    from asyncpp.runtime import step_window

    server = _server()
    pending = SimpleNamespace(
        has_pending_transfers=lambda: True, has_pending_loads=lambda: has_loads, schedule=lambda allow_empty: "poll"
    )
    server.core = SimpleNamespace(scheduler=pending, kv_connector=None)
    before = time.monotonic()
    assert server._schedule_poll() == "poll"
    interval = step_window.POLL_INTERVAL_S if has_loads else step_window.HELD_POLL_INTERVAL_S
    assert before + interval <= server._next_poll_at <= time.monotonic() + interval
