"""A stage stopped with SIGSTOP: past the step deadline every request fails with
EngineDeadError naming that stage, `/health` is no longer true, and the launcher exits 1.

The stop is made on purpose mid-stream (SIGSTOP), and the stage is sent SIGCONT at
the end whatever happened, so nothing stays stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from asyncpp.client import AsyncClient
from asyncpp.errors import EngineDeadError
from tests.conftest import tiny_prompts
from tests.runtime.conftest import log_events, wait_until
from tests.runtime.harness import launched, pid_alive, tiny_sections
from tests.runtime.test_stage_death import LONG, stream_until_failure

STEP_TIMEOUT_S = 3.0
LIVENESS_S = 30  # generous for a busy 2-core machine: a bound, not a speed


async def is_healthy(client: AsyncClient) -> bool:
    """What the HTTP server's /health answers: no reply in time is not healthy."""
    try:
        return await client.health(timeout_s=2.0)
    except (asyncio.TimeoutError, OSError):
        return False


# Stage 1 only: the deadline is per stage alike (`runtime/step_deadline.py`, whose unit tests take every rank);
# a stopped stage restarted instead is `test_stage_restart.py`'s.
@pytest.mark.parametrize("victim", [1])
async def test_a_stopped_stage_fails_every_request_past_the_step_deadline(tmp_path, tiny_hf_dir, victim):
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), parallel={"step_timeout_s": STEP_TIMEOUT_S, "max_stage_restarts": 0})
    prompts = [p[:40] for p in tiny_prompts(320, 8)]
    stopped_pid = None
    try:
        with launched(tmp_path, sections) as engine:
            client = AsyncClient(engine.address)
            try:
                stats = await client.stats()
                pids = stats["stage_pids"]
                first_token = asyncio.Event()
                tasks = [asyncio.create_task(stream_until_failure(client, p, first_token)) for p in prompts]
                await asyncio.wait_for(first_token.wait(), timeout=LIVENESS_S)
                assert await is_healthy(client)
                stopped_pid = pids[victim]
                os.kill(stopped_pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=LIVENESS_S)
                assert not await is_healthy(client)
            finally:
                client.close()
            errors = [e for _, e, _ in results]
            assert all(isinstance(e, EngineDeadError) for e in errors), errors
            assert all(f"stage {victim} hung" in str(e) for e in errors), errors
            assert all(n < LONG.max_tokens for n, _, _ in results)
            # Not before the deadline: the stopped stage's clock started at its last output, just before the stop.
            first_failure_s = min(ended for _, _, ended in results) - stopped_at
            assert STEP_TIMEOUT_S - 0.5 <= first_failure_s <= STEP_TIMEOUT_S + 10, first_failure_s
            print(f"\nstopped stage {victim}: EngineDeadError {first_failure_s:.2f} s after SIGSTOP")
            assert engine.wait(timeout_s=LIVENESS_S) == 1
            wait_until(lambda: not any(pid_alive(p) for p in pids), LIVENESS_S, "stage processes reaped")
            assert log_events(engine.log_file, event="stage_hung", pp_rank=victim) == ["stage_hung"]
            assert "stage_died" not in engine.log_file.read_text()
    finally:
        if stopped_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_pid, signal.SIGCONT)
