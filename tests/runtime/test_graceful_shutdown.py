"""SIGTERM drains: running requests finish (or get a final error once the grace period is over).

Either way new requests are refused while draining, the launcher exits 0,
every stage process is gone and no shared memory or run directory is left.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from pathlib import Path

import pytest

from asyncpp.client import AsyncClient, RequestFailedError
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect, wait_for_event, wait_until
from tests.runtime.harness import launched, pid_alive, shm_segments, tiny_sections

PROMPTS = [p[:40] for p in tiny_prompts(320, 8)]  # 40 + 200 tokens fit max_model_len 256


async def stream(client: AsyncClient, prompt, params, first_token: asyncio.Event):
    """(token ids, finish reason) or the exception that ended the stream."""
    tokens, reason = [], None
    try:
        async for delta in client.generate(prompt, params):
            tokens += delta.token_ids
            reason = delta.finish_reason
            first_token.set()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return tokens, e
    return tokens, reason


@pytest.mark.parametrize(
    "grace_period_s,max_tokens",
    [(60.0, 200), (0.0, 200)],
    ids=["requests-finish", "grace-period-over"],
)
async def test_sigterm_drains_and_cleans_up(tmp_path, tiny_hf_dir, grace_period_s, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), server={"grace_period_s": grace_period_s})
    with launched(tmp_path, sections) as engine:
        client = AsyncClient(engine.address)
        try:
            stats = await client.stats()
            pids, run_id = stats["stage_pids"], stats["run_id"]
            assert len(shm_segments(f"asyncpp-{run_id}")) == 1
            first_token = asyncio.Event()
            tasks = [asyncio.create_task(stream(client, p, params, first_token)) for p in PROMPTS]
            await asyncio.wait_for(first_token.wait(), timeout=30)
            engine.proc.send_signal(signal.SIGTERM)
            sent_at = time.monotonic()
            await wait_for_event(engine.log_file, "engine_draining", 10)
            if grace_period_s > 0:
                # Draining: running requests go on, new ones are refused.
                with pytest.raises(RequestFailedError, match="shutting down"):
                    await asyncio.wait_for(collect(client, PROMPTS[0], params), timeout=10)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        finally:
            client.close()
        exit_code = engine.wait(timeout_s=15)
        print(f"\ngrace {grace_period_s} s: launcher exited {time.monotonic() - sent_at:.2f} s after SIGTERM")

    assert exit_code == 0, "".join(engine.output[-30:])
    wait_until(lambda: not any(pid_alive(p) for p in pids), 5, "stage processes reaped")
    assert shm_segments(f"asyncpp-{run_id}") == []
    assert list(Path(tempfile.gettempdir()).glob(f"asyncpp-{run_id}-*")) == []  # the ipc run directory
    if grace_period_s > 0:
        expected = Engine(tiny_config(tiny_hf_dir)).generate(PROMPTS, params)
        assert [r for r in results] == [(c.token_ids, "length") for c in expected]
    else:
        for tokens, error in results:
            assert isinstance(error, RequestFailedError), error
            assert "engine shut down before the request finished" in str(error)
            assert len(tokens) < max_tokens
