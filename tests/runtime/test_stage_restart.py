"""A stage that dies or hangs is restarted in place: every request finishes with the tokens of an
undisturbed run, and no client sees an error (`asyncpp.runtime.recovery`).

One pp = 3 engine on the tiny model serves 16 requests (greedy and seeded, prompts chunked over
several steps, n-gram drafts on) undisturbed, then again while its first, middle and last stage
are killed in turn (SIGKILL, once some requests decode and others are still in their prompt), then
while one is stopped (SIGSTOP) past the step deadline. A second engine's stage dies at every
restart (the fault hook): a crash loop, which ends as a dead engine does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from asyncpp.client import AsyncClient
from asyncpp.errors import EngineDeadError
from asyncpp.runtime.fault_hooks import FAULT_EXIT_ENV
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.runtime.conftest import collect, poll_until, wait_until
from tests.runtime.harness import launched, pid_alive, shm_segments, tiny_sections
from tests.runtime.test_stage_death import stream_until_failure

LIVENESS_S = 60  # a bound for a busy 2-core machine, not a speed
STEP_TIMEOUT_S = 3.0
NUM_REQUESTS = 16


def _events(log_file) -> list[dict]:
    """The JSON log's events (every process's), as dicts."""
    events = []
    for line in log_file.read_text().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def _requests(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests; long prompts (chunked) and repetitive ones (n-gram drafts)."""
    prompts = [p * 3 for p in tiny_prompts(vocab_size, 12)][:8] + [p[:12] * 4 for p in tiny_prompts(vocab_size, 8, seed=1)]
    requests = []
    for i, prompt in enumerate(prompts[:NUM_REQUESTS]):
        if i % 2:
            params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=1000 + i, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        requests.append((prompt[:200], params))
    return requests


async def _serve_all(client: AsyncClient, requests, disturb=None) -> list[list[int]]:
    """Every request at once; `disturb()` once a few have their first token. Token ids per request."""
    started = asyncio.Event()
    num_started = [0]

    async def one(prompt, params) -> list[int]:
        tokens: list[int] = []
        async for delta in client.generate(prompt, params):
            if not tokens and delta.token_ids:
                num_started[0] += 1
                if num_started[0] == 3:
                    started.set()
            tokens += delta.token_ids
        return tokens

    tasks = [asyncio.create_task(one(p, params)) for p, params in requests]
    if disturb is not None:
        await asyncio.wait_for(started.wait(), timeout=LIVENESS_S)
        await disturb()
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=LIVENESS_S)


async def test_each_stage_killed_or_stopped_in_turn_every_request_finishes_exactly(tmp_path, tiny_hf_dir):
    sections = tiny_sections(
        tiny_hf_dir, 3, (1, 1, 2),
        parallel={"max_stage_restarts": 10, "step_timeout_s": STEP_TIMEOUT_S},
        scheduler={"max_num_batched_tokens": 48},
        speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    )  # fmt: skip
    vocab_size = json.loads((tiny_hf_dir / "config.json").read_text())["vocab_size"]
    requests = _requests(vocab_size)
    torch_files_before = set(shm_segments("torch_"))
    stopped: list[int] = []
    try:
        with launched(tmp_path, sections) as engine:
            client = AsyncClient(engine.address)
            try:
                stats = await client.stats()
                run_id = stats["run_id"]
                expected = await _serve_all(client, requests)
                assert all(len(tokens) == 40 for tokens in expected)
                for restarts, victim in enumerate([0, 1, 2], start=1):
                    pids = (await client.stats())["stage_pids"]

                    async def kill() -> None:
                        os.kill(pids[victim], signal.SIGKILL)

                    assert await _serve_all(client, requests, kill) == expected, f"stage {victim} killed"
                    stats = await client.stats()
                    assert stats["stage_restarts"] == restarts and len(stats["stage_recovery_s"]) == restarts
                    assert not set(stats["stage_pids"]) & set(pids) and all(pid_alive(p) for p in stats["stage_pids"])
                pids = (await client.stats())["stage_pids"]

                async def stop() -> None:
                    stopped.append(pids[1])
                    os.kill(pids[1], signal.SIGSTOP)

                assert await _serve_all(client, requests, stop) == expected, "stage 1 stopped"
                stats = await client.stats()
                assert stats["stage_restarts"] == 4 and stats["num_recomputed_requests"] > 0
                assert stats["num_recomputed_tokens"] > 0 and not stats["is_dead"]
                assert stats["num_running"] == stats["num_waiting"] == 0
                assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
            finally:
                client.close()
            final_pids = stats["stage_pids"]
    finally:
        for pid in stopped:  # killed by the restart; never leave a stopped process behind
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
    assert engine.proc.returncode == 0, "".join(engine.output[-40:])
    events = _events(engine.log_file)
    lost = [e for e in events if e.get("event") == "stage_lost"]
    assert [(e["pp_ranks"], e["cause"]) for e in lost] == [([0], "exited"), ([1], "exited"), ([2], "exited"), ([1], "hung")]
    for phase in ("recovery_requeued", "stages_restarted", "stage_recovered"):
        assert sum(e.get("event") == phase for e in events) == 4, phase
    wait_until(lambda: not any(pid_alive(p) for p in final_pids), LIVENESS_S, "stage processes reaped")
    assert shm_segments(f"asyncpp-{run_id}") == []
    assert set(shm_segments("torch_")) <= torch_files_before


async def test_a_request_aborted_during_a_restart_is_freed(tmp_path, tiny_hf_dir):
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), parallel={"max_stage_restarts": 3})
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with launched(tmp_path, sections) as engine:
        client = AsyncClient(engine.address)
        try:
            pids = (await client.stats())["stage_pids"]
            first_token = asyncio.Event()
            kept = asyncio.create_task(stream_until_failure(client, [5, 6, 7, 8], first_token))
            dropped = asyncio.create_task(collect(client, [9, 10, 11], long))
            await asyncio.wait_for(first_token.wait(), timeout=LIVENESS_S)
            os.kill(pids[1], signal.SIGKILL)
            await poll_until(client.stats, lambda s: s["stage_restarts"] == 1, LIVENESS_S, interval_s=0.01)
            dropped.cancel()  # the client aborts it while the new stages start
            num_tokens, error, _ = await asyncio.wait_for(kept, timeout=LIVENESS_S)
            assert error is None and num_tokens == long.max_tokens
            stats = await poll_until(client.stats, lambda s: s["num_running"] + s["num_waiting"] == 0, LIVENESS_S)
            assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["stage_restarts"] == 1
        finally:
            client.close()
    assert engine.proc.returncode == 0


async def test_a_crash_loop_ends_in_engine_dead_after_the_restart_limit(tmp_path, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv(FAULT_EXIT_ENV, "1:1")  # stage 1 dies as it starts, from its first restart on
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), parallel={"max_stage_restarts": 2, "restart_window_s": 600.0})
    prompts = [p[:40] for p in tiny_prompts(320, 6)]
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with launched(tmp_path, sections) as engine:
        client = AsyncClient(engine.address)
        try:
            stats = await client.stats()
            pids, run_id = stats["stage_pids"], stats["run_id"]
            first_token = asyncio.Event()
            tasks = [asyncio.create_task(stream_until_failure(client, p, first_token)) for p in prompts]
            await asyncio.wait_for(first_token.wait(), timeout=LIVENESS_S)
            os.kill(pids[1], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=LIVENESS_S)
            failed_at = time.time()
        finally:
            client.close()
        assert engine.wait(timeout_s=LIVENESS_S) == 1
    errors = [e for _, e, _ in results]
    assert all(isinstance(e, EngineDeadError) for e in errors), errors
    assert all("not restarted" in str(e) and "a restart failed" in str(e) for e in errors), errors[0]
    events = _events(engine.log_file)
    failures = [e for e in events if e.get("event") == "stage_restart_failed"]
    assert len(failures) == 2  # the limit: 2 restarts, both died at start
    last_failure_s = failures[-1]["t_us"] / 1e6
    assert failed_at - last_failure_s <= 2.0, f"{failed_at - last_failure_s:.2f} s from the last failure to the errors"
    assert shm_segments(f"asyncpp-{run_id}") == []
