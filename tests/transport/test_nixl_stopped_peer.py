"""`NixlTransport` reading from a peer process that is stopped (SIGSTOP): the read stays RUNNING
(cma may copy the bytes, but its notification is never acknowledged), `release` gives up after its
timeout and keeps the handle, and `release_ended` frees it once the peer resumed (SIGCONT)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid

import pytest
import torch

from asyncpp.transport.nixl_agent import NixlTransport, TransferState

pytest.importorskip("nixl_cu12")


def _peer(name: str, conn) -> None:
    src = torch.arange(1 << 16, dtype=torch.float32)
    with NixlTransport(name) as transport:
        transport.register([src])
        conn.send((transport.agent_metadata(), src.data_ptr(), src.nbytes))
        while not conn.poll(0.01):
            transport.get_notifs()  # progress, as a stage's loop does
        conn.recv()


def stop(pid: int) -> None:
    """SIGSTOP, returning once every thread of the process is stopped (the signal is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not all(_state(pid, tid) == "T" for tid in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.001)


def _state(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_read_from_a_stopped_peer_is_abandoned_then_released_once_it_resumes():
    tag = uuid.uuid4().hex[:6]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(f"peer-{tag}", child), daemon=True)
    peer.start()
    try:
        metadata, addr, nbytes = conn.recv()
        dst = torch.zeros(nbytes // 4, dtype=torch.float32)
        with NixlTransport(f"reader-{tag}", release_timeout_s=0.01) as reader:
            reader.register([dst])
            remote = reader.add_remote(metadata)
            warm = reader.read(remote, [(dst.data_ptr(), addr, 4096)], b"warm")  # the connection is up
            deadline = time.monotonic() + 10
            while reader.poll(warm) is TransferState.RUNNING and time.monotonic() < deadline:
                time.sleep(0.001)
            reader.release(warm)
            stop(peer.pid)
            try:
                handle = reader.read(remote, [(dst.data_ptr(), addr, nbytes)], b"stopped")
                time.sleep(0.5)
                assert reader.poll(handle) is TransferState.RUNNING
                with pytest.raises(TimeoutError, match="still runs"):
                    reader.release(handle)
                assert reader.release_ended() == 1  # still running: kept
            finally:
                os.kill(peer.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while reader.release_ended() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert reader.release_ended() == 0 and reader.poll(handle) is TransferState.DONE
            assert torch.equal(dst, torch.arange(nbytes // 4, dtype=torch.float32))
        conn.send("stop")
        peer.join(10)
    finally:
        if peer.is_alive():
            peer.kill()
