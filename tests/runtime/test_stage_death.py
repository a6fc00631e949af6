"""A stage killed with SIGKILL and not restarted: every request fails with EngineDeadError, and nothing is left behind.

"Fast" is a liveness bound here (generous, for a busy 2-core machine), not a
speed limit: how fast belongs in the logs and benchmarks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncpp.client import AsyncClient
from asyncpp.errors import EngineDeadError
from asyncpp.runtime.stage_group import unlink_torch_shm
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.runtime.conftest import poll_until, wait_until
from tests.runtime.harness import launched, pid_alive, shm_segments, tiny_sections

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
NUM_RUNNING = 20
NUM_QUEUED = 4
LIVENESS_S = 30  # every stream has ended, the launcher exited, the stages are reaped: within this


async def stream_until_failure(client: AsyncClient, prompt, first_token: asyncio.Event) -> tuple[int, BaseException | None, float]:
    """(tokens received, the exception that ended the stream, when it ended)."""
    num_tokens = 0
    try:
        async for delta in client.generate(prompt, LONG):
            num_tokens += len(delta.token_ids)
            first_token.set()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return num_tokens, e, time.monotonic()
    return num_tokens, None, time.monotonic()


@pytest.mark.parametrize(
    "device,connector",
    [("cpu", None), ("cpu", "offload"), pytest.param("cuda", None, marks=pytest.mark.cuda)],
)
@pytest.mark.parametrize("victim", ["first", "last"])
async def test_killing_a_stage_fails_every_request_fast(tmp_path, tiny_hf_dir, victim, device, connector):
    # At most 20 running requests, so the extra ones stay queued.
    sections = tiny_sections(
        tiny_hf_dir, 2, (2, 2), scheduler={"max_num_seqs": NUM_RUNNING}, model={"device": device},
        parallel={"max_stage_restarts": 0},  # fail-stop (restarts: test_stage_restart.py)
    )  # fmt: skip
    if connector is not None:  # its stores are shared memory too (asyncpp-<run id>-kv0-<rank>)
        sections["kv_transfer"] = {"connector": connector, "store_size_mb": 2}
    # CUDA: the ring is GPU memory shared through IPC handles, but torch keeps a reference
    # counter for shared CUDA memory in /dev/shm (torch_*): none may outlive the run either.
    torch_files_before = set(shm_segments("torch_"))
    prompts = [p[:40] for p in tiny_prompts(320, 12) * 2][: NUM_RUNNING + NUM_QUEUED]  # 40 + 200 fit 256
    with launched(tmp_path, sections) as engine:
        client = AsyncClient(engine.address)
        try:
            stats = await client.stats()
            pids, run_id = stats["stage_pids"], stats["run_id"]
            assert len(pids) == 2 and all(pid_alive(p) for p in pids)
            # Stage 1's receive ring: a shared-memory segment on CPU, GPU memory on CUDA.
            num_kv_segments = 2 if connector == "offload" else 0  # one store per stage
            assert len(shm_segments(f"asyncpp-{run_id}-kv")) == num_kv_segments
            assert len(shm_segments(f"asyncpp-{run_id}")) == (1 if device == "cpu" else 0) + num_kv_segments
            first_token = asyncio.Event()
            tasks = [asyncio.create_task(stream_until_failure(client, p, first_token)) for p in prompts]
            await asyncio.wait_for(first_token.wait(), timeout=LIVENESS_S)
            stats = await poll_until(
                client.stats, lambda s: s["num_running"] + s["num_waiting"] == len(prompts), LIVENESS_S
            )
            assert 0 < stats["num_running"] <= NUM_RUNNING and stats["num_waiting"] >= NUM_QUEUED, stats
            victim_pid = pids[0] if victim == "first" else pids[-1]
            os.kill(victim_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=LIVENESS_S)
        finally:
            client.close()
        last_failure_s = max(ended for _, _, ended in results) - killed_at
        errors = [e for _, e, _ in results]
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert all("engine is dead" in str(e) for e in errors)
        assert any(n > 0 for n, _, _ in results) and all(n < LONG.max_tokens for n, _, _ in results)
        print(f"\nkilled stage {victim}: last EngineDeadError {last_failure_s * 1e3:.0f} ms after the kill")

        exit_code = engine.wait(timeout_s=LIVENESS_S)
        print(f"launcher exited with {exit_code} {time.monotonic() - killed_at:.2f} s after the kill")
        assert exit_code != 0
        wait_until(lambda: not any(pid_alive(p) for p in pids), LIVENESS_S, "stage processes reaped")
        assert shm_segments(f"asyncpp-{run_id}") == []  # the ring and the offload stores alike
        assert set(shm_segments("torch_")) <= torch_files_before
        assert "stage_died" in engine.log_file.read_text()


def test_unlink_torch_shm_removes_only_that_process_files(tmp_path):
    # torch names its shared-memory files /dev/shm/torch_<pid>_<random>_<n>; pid 12's files
    # must go, and neither pid 123's nor anything else.
    for name in ["torch_12_4242_0", "torch_12_4242_1", "torch_123_77_0", "asyncpp-12-ring", "torch_x"]:
        (tmp_path / name).write_bytes(b"\0" * 8)
    assert sorted(unlink_torch_shm(12, tmp_path)) == ["torch_12_4242_0", "torch_12_4242_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["asyncpp-12-ring", "torch_123_77_0", "torch_x"]
    assert unlink_torch_shm(12, tmp_path) == []


def test_unlink_torch_shm_removes_the_cuda_drivers_event_files(tmp_path):
    # The CUDA driver keeps a process's interprocess events in /dev/shm/cuda.shm.<n>.<pid hex>.<n>
    # (seen on an H200: cuda.shm.0.2ff.1 and the like); pid 767 is 0x2ff, pid 0x2ff0 is another.
    names = ["cuda.shm.0.2ff.1", "cuda.shm.0.2ff.2", "cuda.shm.0.2ff0.1", "cuda.shm.0.12.1", "cuda.shm.2ff"]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 8)
    assert sorted(unlink_torch_shm(767, tmp_path)) == ["cuda.shm.0.2ff.1", "cuda.shm.0.2ff.2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda.shm.0.12.1", "cuda.shm.0.2ff0.1", "cuda.shm.2ff"]
