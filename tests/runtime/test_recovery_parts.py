"""The parts of a stage restart that need no process: the budget, the fault hook, a closed socket's
waiters, and the step window's pause (`asyncpp.runtime.recovery`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import zmq

from asyncpp.runtime.fault_hooks import FAULT_EXIT_CODE, FAULT_EXIT_ENV, INCARNATION_ENV, exit_if_faulted, is_faulted
from asyncpp.runtime.recovery import RestartBudget
from asyncpp.runtime.spare_cpus import SpareCpus
from asyncpp.wire.loop_socket import LoopSocket, SocketClosedError
from asyncpp.wire.stage_msgs import StageOutput
from asyncpp.worker.outputs import ModelRunnerOutput
from tests.runtime.test_lend_threads import _add, _dispatch, _server


def test_the_budget_counts_restarts_within_its_window():
    budget = RestartBudget(2, 60.0)
    assert budget.take(0.0) and budget.take(10.0)
    assert not budget.take(59.9)  # two within the last 60 s already
    assert budget.take(60.0)  # the first left the window
    assert not budget.take(69.9) and budget.take(70.0)
    assert not RestartBudget(0, 60.0).take(0.0)


@pytest.mark.parametrize(
    "spec,incarnation,exits",
    [("1:1", "1", True), ("1:1", "2", True), ("1:1", "0", False), ("0:1", "1", False), ("1", "0", True), ("", "5", False)],
)
def test_the_fault_hook_exits_only_the_stage_and_incarnations_it_names(spec, incarnation, exits):
    code = "from asyncpp.runtime.fault_hooks import exit_if_faulted; exit_if_faulted(1); print('alive')"
    env = {FAULT_EXIT_ENV: spec, INCARNATION_ENV: incarnation, "PYTHONPATH": ":".join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == ((FAULT_EXIT_CODE, "") if exits else (0, "alive"))


def test_without_the_fault_variable_nothing_happens():
    exit_if_faulted(0, {})
    exit_if_faulted(0, {INCARNATION_ENV: "3"})


@pytest.mark.parametrize(
    "spec,rank,incarnation,faulted",
    [
        ("1:1", 1, None, False),  # the first processes: incarnation 0
        ("1:1", 1, "1", True), ("1:2", 1, "1", False), ("1:2", 1, "2", True), ("1:2", 1, "3", True),
        ("1:0", 0, "0", False), ("2", 2, None, True), ("0:", 0, "0", True), (None, 0, "9", False),
    ],
)  # fmt: skip
def test_is_faulted_reads_the_rank_and_the_first_incarnation(spec, rank, incarnation, faulted):
    environ = {k: v for k, v in ((FAULT_EXIT_ENV, spec), (INCARNATION_ENV, incarnation)) if v is not None}
    assert is_faulted(rank, environ) is faulted


async def test_closing_a_socket_fails_a_send_waiting_on_it():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.bind("inproc://closed-under-a-waiter")  # no peer: a send waits
    io = LoopSocket(sock)
    send = asyncio.ensure_future(io.send(b"plan"))
    await asyncio.sleep(0.01)
    assert not send.done()
    io.close()
    with pytest.raises(SocketClosedError):
        await asyncio.wait_for(send, timeout=5)


def test_a_paused_window_dispatches_nothing_and_ignores_the_forgotten_steps():
    window = _server(pp_size=2)
    _add(window, "a")
    plans = _dispatch(window)
    assert len(plans) == 2 and len(window.in_flight) == 2
    assert window.pause() == 2
    assert window.in_flight == {} and window.cohorts == []
    window.core.scheduler.recompute_all()
    assert _dispatch(window) == []  # paused: the request waits
    window.resume()
    (plan,) = _dispatch(window)[:1]
    assert plan.step_id > plans[-1].step_id and plan.scheduled[0].request_id == "a"
    assert window.last_output_at[0] > 0  # the step deadline starts over


def test_resume_measures_spare_cpus_against_the_new_stage_processes():
    window = _server(pp_size=2)
    tracked: list = []
    window.spare_cpus = SimpleNamespace(track=tracked.append)
    window.stages.procs = [SimpleNamespace(pid=101), SimpleNamespace(pid=102)]
    window.pause()
    window.resume()
    assert tracked == [[os.getpid(), 101, 102]]


def test_spare_cpus_track_the_new_processes_from_a_fresh_reading():
    spare = SpareCpus([2**22 + 1], interval_s=0.0)  # a gone pid: the restarted stages' old one
    sum(i * i for i in range(200_000))  # CPU time of this process, before it is ours
    spare.track([os.getpid()])
    assert spare.pids == [os.getpid()]
    assert spare._last is not None and spare._last[2] > 0.0  # our time so far is the new baseline


async def test_a_late_output_of_a_forgotten_step_is_dropped_quietly(capsys):
    window = _server(pp_size=2)
    _add(window, "a")
    await window._dispatch()
    (first, _) = window.stages.plans
    window.pause()
    outputs: asyncio.Queue = asyncio.Queue()
    window.stages.outputs = outputs
    await outputs.put(StageOutput(first.step_id, 0, ModelRunnerOutput(), 0.0, 0.0, None))
    await outputs.put(StageOutput(first.step_id + 100, 0, ModelRunnerOutput(), 0.0, 0.0, None))
    loop_task = asyncio.ensure_future(window.output_loop())
    while not outputs.empty() or not window.is_reading:
        await asyncio.sleep(0.001)
    loop_task.cancel()
    await asyncio.gather(loop_task, return_exceptions=True)
    err = capsys.readouterr()
    logged = err.out + err.err
    assert logged.count("unknown_step_output") == 1 and f"step_id={first.step_id + 100}" in logged
