"""Preemption while offload saves are in flight (in-process, tiny model, pp=2).

A preempted request's blocks are freed at once and reused by the next plan,
so every stage must finish (or drop) the saves that still read them before
it runs that plan. The store's writes are held on a gate until a stage is
inside `handle_preemptions`; the stage may return only once those saves are
written, and the greedy tokens match an engine that never preempts.
"""

from __future__ import annotations

import threading

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
# Four prompts of 3..33 tokens grow to 51..81: up to 6 blocks each, 12 blocks for all force preemptions.
NUM_KV_BLOCKS = 12
# How long the gate stays shut once a stage waits: the window in which a stage that does not wait
# would run on. Only widens that window; a stage that waits passes however slow the machine is.
GATE_HOLD_S = 0.2


def offload_engine(tiny_hf_dir) -> Engine:
    return Engine(
        tiny_config(
            tiny_hf_dir,
            model={"max_model_len": 128},  # the cache must hold one whole request
            parallel={"pp_size": 2, "layer_split": (2, 2)},
            cache={"num_kv_blocks_override": NUM_KV_BLOCKS},
            kv_transfer={"connector": "offload", "store_size_mb": 2},
        )
    )


def hold_writes_until_a_preemption(e: Engine) -> list[tuple[tuple[str, ...], int, bool]]:
    """Gate every stage's store writes; returns, per `handle_preemptions` call that had saves of the
    preempted requests in flight: (their ids, the number of such save jobs, all written on return)."""
    gate = threading.Event()
    waits = []
    for runner in e.executor.runners:
        worker = runner.kv_connector.connector
        # The shared-memory store writes in place: `begin_write` comes before the cache is read.
        begin_write = worker.store.begin_write

        def gated_begin_write(*args, _begin=begin_write):
            assert gate.wait(30), "no preemption opened the gate"
            return _begin(*args)

        worker.store.begin_write = gated_begin_write
        handle = worker.handle_preemptions

        def watched(preempted_req_ids, _worker=worker, _handle=handle):
            preempted = set(preempted_req_ids)
            # The save jobs still reading the preempted requests' blocks (the worker's own list).
            jobs = [job for job in _worker._save_jobs if not preempted.isdisjoint(job.request_ids)]
            if jobs:
                threading.Timer(GATE_HOLD_S, gate.set).start()
            _handle(preempted_req_ids)
            if jobs:
                waits.append((tuple(preempted_req_ids), len(jobs), all(job.future.done() for job in jobs)))

        worker.handle_preemptions = watched
    return waits


def test_a_preempted_requests_saves_are_written_before_its_blocks_are_reused(tiny_hf_dir):
    prompts = tiny_prompts(320, 4)
    expected = [o.token_ids for o in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]
    e = offload_engine(tiny_hf_dir)
    waits = hold_writes_until_a_preemption(e)
    outputs = [o.token_ids for o in e.generate(prompts, GREEDY)]
    assert e.scheduler.stats().num_preemptions > 0
    assert waits, "no stage was told of a preempted request whose saves were in flight"
    assert all(is_written for _, _, is_written in waits), waits
    assert outputs == expected
    while e.has_pending_transfers():
        e.step()
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    e.close()
