"""Every control address a Ray run reports is bound, by a socket that takes the run's token, as soon as
the stages are placed and before any of them runs: no port is picked free and bound later, so no other
local user can take one in between and be handed the token."""

from __future__ import annotations

import time

import pytest
import ray
import zmq

from asyncpp.config import ParallelConfig
from asyncpp.runtime.addresses import RunAddresses
from asyncpp.runtime.ray_backend import RayStageGroup
from asyncpp.runtime.stage_process import StageArgs

HANDSHAKE_TIMEOUT_S = 5.0


def _stage_args(pp_size: int, addresses: RunAddresses) -> list[StageArgs]:
    """Placement reads only the ranks, devices and threads: nothing is loaded before `start`."""
    return [
        StageArgs(
            pp_rank=rank, pp_size=pp_size, start_layer=rank, end_layer=rank + 1, model_source="none",
            model_path=None, dtype="float32", device="cpu", linear_kernel="torch", fma_min_rows=(None, None), num_threads=1,
            block_size=16, kv_cache_memory_mb=1, max_num_batched_tokens=16, num_ring_slots=2,
            transport="shm", addresses=addresses, async_scheduling=True,
        )  # fmt: skip
        for rank in range(pp_size)
    ]


def _handshakes(address: str, kind: int, token: str) -> bool:
    """Whether a peer presenting `token` completes the ZMQ handshake with whatever is bound at `address`."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.plain_username, sock.plain_password = b"asyncpp", token.encode()
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(address)
        return bool(monitor.poll(int(HANDSHAKE_TIMEOUT_S * 1000)))
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


@pytest.fixture
def placed(ray_cluster):
    """A 3-stage group placed on the simulated nodes, not started; the test session's Ray connection back after."""
    ray.shutdown()  # the group connects itself, as the launcher does
    addresses = RunAddresses.create()
    group = None
    try:
        group = RayStageGroup(_stage_args(3, addresses), addresses, ParallelConfig(
            pp_size=3, backend="ray", ray_address=ray_cluster.address))  # fmt: skip
        yield group
    finally:
        if group is not None:
            group.reap()  # ends with ray.shutdown()
        ray.init(address=ray_cluster.address, namespace="asyncpp", logging_level="warning")


def test_every_reported_address_is_bound_before_start(placed):
    addrs = placed.addresses
    assert not placed._runs  # placed, not started: no stage has run a line of `stage_main`
    # The engine pushes plans and pulls outputs; stages 1 and 2 pull activations, stage 0 sampled tokens.
    expected = [(a, zmq.PULL) for a in addrs.plan_addrs] + [(addrs.stage_outputs, zmq.PUSH)]
    expected += [(a, zmq.PUSH) for a in (*addrs.activation_addrs[1:], addrs.sampled_tokens)]
    t0 = time.monotonic()
    unbound = [a for a, kind in expected if not _handshakes(a, kind, addrs.token)]
    assert unbound == [], f"reported but not bound before start: {unbound} (checked in {time.monotonic() - t0:.1f} s)"
    assert len({a for a, _ in expected}) == len(expected) == 3 + 1 + 2 + 1
