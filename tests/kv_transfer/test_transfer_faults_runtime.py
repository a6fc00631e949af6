"""KV-transfer failure paths in the launched runtime (stage processes, tiny model, pp=2): failing
steps, failing and hanging saves and loads, a connector that never reports, a stage killed.

The faults of `tests.kv_transfer.faults` are injected through config alone,
in every stage process. After each, the engine must settle on its own:
nothing held for a transfer, no store slot pending or pinned, every block
free, and no more polling plans (its step count stops moving). The next
request is then served token for token.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from asyncpp.client import AsyncClient, RequestFailedError
from asyncpp.engine.engine import Engine
from asyncpp.errors import EngineDeadError
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect, is_idle, log_events, poll_until
from tests.runtime.harness import launched, shm_segments, tiny_sections

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFIX = [(7 * i + 3) % 300 + 3 for i in range(160)]
FIRST, LATER = PREFIX + list(range(40, 60)), PREFIX + list(range(200, 230))
MODULE = "tests.kv_transfer.faults"


def settled(stats: dict) -> bool:
    return (
        is_idle(stats)
        and stats["num_held_for_transfer"] == 0
        and stats["num_waiting_for_remote_kvs"] == 0
        and stats.get("kv_store_pending_blocks", 0) == 0
        and stats.get("kv_store_pinned_blocks", 0) == 0
    )


async def assert_settles(client: AsyncClient) -> dict:
    stats = await poll_until(client.stats, settled, 30)
    await asyncio.sleep(0.2)  # an engine still polling its stages sends a plan every millisecond
    again = await client.stats()
    assert again["num_steps"] == stats["num_steps"], "the engine keeps polling with nothing pending"
    return again


def sections(tiny_hf_dir, kv: dict, pp_size: int = 2) -> dict:
    return tiny_sections(
        tiny_hf_dir, pp_size, (2, 2) if pp_size == 2 else (),
        cache={"num_kv_blocks_override": 20},
        scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 64},  # prompts take several steps
        kv_transfer={"module": MODULE, "store_size_mb": 1, **kv},
    )  # fmt: skip


@pytest.fixture(scope="module")
def expected_later(tiny_hf_dir):
    return Engine(tiny_config(tiny_hf_dir, cache={"num_kv_blocks_override": 20})).generate([LATER], GREEDY)[0].token_ids


@pytest.mark.parametrize(
    "pp_size,where,stage",
    [(2, "forward", 1), (2, "forward", 0), (2, "sample", 1), (2, "load_start", 1), (1, "forward", 0), (1, "sample", 0)],
    ids=lambda v: str(v),
)
async def test_a_step_failing_on_a_stage_fails_its_request_and_the_engine_settles(
    tmp_path, tiny_hf_dir, expected_later, pp_size, where, stage
):
    kv = {"connector": "faulty", "options": {"fail_at": where, "fail_pp_rank": stage, "fail_on_save": 3 if where == "sample" else 1}}
    with launched(tmp_path, sections(tiny_hf_dir, kv, pp_size)) as engine:
        client = AsyncClient(engine.address)
        try:
            with pytest.raises(RequestFailedError, match="injected fault"):
                await collect(client, FIRST, GREEDY)
            await assert_settles(client)
            tokens, _, _ = await collect(client, LATER, GREEDY)
            assert tokens == expected_later
            await assert_settles(client)
        finally:
            client.close()
    assert "step_failed" in log_events(engine.log_file, pp_rank=stage)


async def test_transfers_that_never_finish_time_out_in_every_stage(tmp_path, tiny_hf_dir):
    prompts = tiny_prompts(320, 4)
    reference = [c.token_ids for c in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]
    kv = {"connector": "stuck", "options": {"load_blocks": 1}, "load_timeout_s": 0.2, "save_timeout_s": 0.2}
    with launched(tmp_path, sections(tiny_hf_dir, kv)) as engine:
        client = AsyncClient(engine.address)
        try:
            results = await asyncio.gather(*(collect(client, p, GREEDY) for p in prompts))
            stats = await assert_settles(client)
        finally:
            client.close()
    assert [tokens for tokens, _, _ in results] == reference  # timed-out loads were recomputed
    assert stats["num_timed_out_transfers"] >= len(prompts) and stats["num_failed_load_tokens"] > 0
    timed_out = log_events(engine.log_file, event="kv_transfer_timed_out")
    assert timed_out and all(e == "kv_transfer_timed_out" for e in timed_out)
    for rank in (0, 1):  # each stage was told to stop them, and said so
        assert "kv_transfer_aborted" in log_events(engine.log_file, pp_rank=rank)


@pytest.mark.parametrize(
    "pp_size,options,timeouts",
    [
        (2, {"save_fault": "hang", "hang_s": 2.0, "fault_pp_rank": 1}, {"save_timeout_s": 0.3}),
        (2, {"load_fault": "raise", "fault_pp_rank": 0}, {}),
        (2, {"load_fault": "hang", "hang_s": 2.0, "fault_pp_rank": 1}, {"load_timeout_s": 0.3}),
        (1, {"load_fault": "hang", "hang_s": 2.0}, {"load_timeout_s": 0.3}),
    ],
    ids=["save-hangs", "load-raises", "load-hangs", "pp1-load-hangs"],
)
async def test_failing_and_hanging_transfers_in_stage_processes(
    tmp_path, tiny_hf_dir, expected_later, pp_size, options, timeouts
):
    filler = [(11 * i + 1) % 290 + 5 for i in range(200)]  # flushes FIRST out of the 20-block cache
    kv = {"connector": "faulty", "options": options, **timeouts}
    with launched(tmp_path, sections(tiny_hf_dir, kv, pp_size)) as engine:
        client = AsyncClient(engine.address)
        try:
            for prompt in (FIRST, filler, filler[::-1]):
                await collect(client, prompt, GREEDY)
            await assert_settles(client)
            tokens, _, _ = await collect(client, LATER, GREEDY)
            stats = await assert_settles(client)
        finally:
            client.close()
    assert tokens == expected_later  # whatever failed was recomputed
    if "load_fault" in options:
        assert stats["num_failed_load_tokens"] > 0 and stats["num_external_prefix_hit_tokens"] == 0
    if timeouts:
        assert stats["num_timed_out_transfers"] >= 1


async def test_a_stage_dying_with_the_offload_connector_leaves_no_store_behind(tmp_path, tiny_hf_dir):
    """With restarts off (the restart, which adopts the stores, is `test_stage_restart_offload.py`'s)."""
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    fail_stop = sections(tiny_hf_dir, {"connector": "offload"})
    fail_stop["parallel"]["max_stage_restarts"] = 0
    with launched(tmp_path, fail_stop) as engine:
        client = AsyncClient(engine.address)
        try:
            stats = await client.stats()
            run_id = stats["run_id"]
            stream = asyncio.create_task(collect(client, FIRST[:40], long))
            await poll_until(client.stats, lambda s: s["kv_blocks_saved"] > 0, 30)
            assert len([name for name in shm_segments() if run_id in name and "-kv" in name]) == 2  # the stores
            os.kill(stats["stage_pids"][1], signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(stream, timeout=30)
        finally:
            client.close()
        assert engine.wait(timeout_s=30) != 0
    assert not [name for name in shm_segments() if run_id in name]  # the dead stage's store too
