"""Every failure path of a KV transfer ends, and frees everything it held (in-process, tiny model).

Faults come from `tests.kv_transfer.faults` (config only): a step that fails
before, in or after its forward on any stage, at a request's first or
second save; saves and loads that raise or hang; a connector that never
reports. After each, `assert_settled` checks that nothing is held, pending,
pinned or half-reported, that no stage owes a report, that the engine sends
no more plans, and the next request is served token for token.
"""

from __future__ import annotations

import pytest

import tests.kv_transfer.faults  # noqa: F401  (registers the connectors, wraps the runner)
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SPLITS = {1: (), 2: (1, 3)}
BLOCK = 16
PREFIX = [(7 * i + 3) % 300 + 3 for i in range(10 * BLOCK)]
FIRST = PREFIX + list(range(40, 60))
LATER = PREFIX + list(range(200, 230))
FILLERS = [[(11 * i + k) % 290 + 5 for i in range(200)] for k in (1, 2)]
MODULE = "tests.kv_transfer.faults"


def engine(tiny_hf_dir, pp_size: int = 2, connector: str = "faulty", **kv) -> Engine:
    kv = {"connector": connector, "module": MODULE, "store_size_mb": 1, **kv}
    return Engine(
        tiny_config(
            tiny_hf_dir,
            parallel={"pp_size": pp_size, "layer_split": SPLITS[pp_size]},
            cache={"num_kv_blocks_override": 20},
            # Prompts take several chunks: a request saves on several steps.
            scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 64},
            kv_transfer=kv,
        )
    )


def run(e: Engine, prompt: list[int]):
    return e.generate([prompt], GREEDY)[0]


@pytest.fixture(scope="module")
def expected(tiny_hf_dir):
    plain = Engine(tiny_config(tiny_hf_dir, cache={"num_kv_blocks_override": 20}))
    return {name: run(plain, p).token_ids for name, p in (("first", FIRST), ("later", LATER))}


def assert_settled(e: Engine) -> None:
    """Nothing of any transfer is left, anywhere, and the engine would send no plan."""
    s = e.scheduler
    assert s.num_held_for_transfer == 0 and s.num_waiting_for_remote_kvs == 0
    assert s.num_partly_reported_transfers == 0
    assert not e.has_pending_transfers() and s.schedule(allow_empty=False) is None  # no polling plans
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    for runner in e.executor.runners:
        assert runner.kv_connector.ledger.num_owed == 0
    stats = e.kv_connector.stats()
    if "kv_store_pending_blocks" in stats:
        assert stats["kv_store_pending_blocks"] == 0 and stats["kv_store_pinned_blocks"] == 0
        for runner in e.executor.runners:
            worker = runner.kv_connector.connector
            assert worker.is_idle


def flush(e: Engine) -> None:
    for filler in FILLERS:  # 13 blocks each: nothing of FIRST stays in a 20-block cache
        run(e, filler)


# FIRST's prompt takes 3 chunks of 64 tokens, each saving blocks (the 3rd also samples), then it decodes.
STEP_FAULTS = [  # (where, which stage: 0 or -1 for the last, which of its steps)
    *(
        (where, stage, arm)
        for where, stage in (("load_start", 0), ("forward", 0), ("forward", -1), ("save_kv", -1))
        for arm in ({"fail_on_save": 1}, {"fail_on_save": 2})
    ),
    *((where, -1, arm) for where in ("sample", "propose") for arm in ({"fail_on_save": 3}, {"fail_on_step": 5})),
]


@pytest.mark.parametrize("pp_size", [1, 2])
@pytest.mark.parametrize("where,stage,arm", STEP_FAULTS)
def test_a_failed_step_fails_its_request_and_strands_nothing(tiny_hf_dir, expected, pp_size, where, stage, arm):
    options = {"fail_at": where, "fail_pp_rank": stage % pp_size, **arm}
    e = engine(tiny_hf_dir, pp_size, options=options)
    failed = run(e, FIRST)
    assert failed.finish_reason == "error" and "injected fault" in failed.error
    assert_settled(e)
    ready = e.kv_connector.stats()["kv_store_ready_blocks"]
    if where in ("sample", "propose"):
        assert ready > 0  # the forward ended on every stage: its saves are good and kept
    else:
        assert ready == 0  # a stage skipped or lost a save: none of the request's slots is trusted
    # The engine goes on: a request sharing the prefix is exact, and its saves are kept.
    assert run(e, LATER).token_ids == expected["later"]
    assert_settled(e)
    assert e.kv_connector.stats()["kv_store_ready_blocks"] > ready
    e.close()


@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_step_that_starts_loads_and_fails_in_sampling_starts_each_load_once(tiny_hf_dir, expected, pp_size):
    """Sampling fails on the last stage in the step that starts a load: the load is started once per
    stage (not again by the failure path), it completes, and the loading request is exact."""
    e = engine(tiny_hf_dir, pp_size, options={"fail_at": "sample", "fail_pp_rank": pp_size - 1, "fail_on_load": True})
    run(e, FIRST)
    flush(e)
    decoding = e.add_request(FILLERS[0][:40], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    while not e.scheduler.num_running:  # it samples in every step from now on
        e.step()
    later = e.add_request(LATER, GREEDY)
    outs: dict[str, list] = {decoding: [], later: []}
    while e.has_unfinished_requests() or e.has_pending_transfers():
        for out in e.step():
            outs[out.request_id].append(out)
    assert outs[decoding][-1].finish_reason == "error"  # sampled in the failed step
    assert [t for out in outs[later] for t in out.token_ids] == expected["later"]
    assert e.scheduler.stats().num_external_prefix_hit_tokens > 0  # LATER's prefix came from the store
    for runner in e.executor.runners:
        assert runner.kv_connector.connector.num_loads_started == {later: 1}
    assert_settled(e)
    e.close()


@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_save_that_raises_never_makes_its_slots_loadable(tiny_hf_dir, expected, pp_size):
    e = engine(tiny_hf_dir, pp_size, options={"save_fault": "raise", "fault_pp_rank": pp_size - 1})
    assert run(e, FIRST).token_ids == expected["first"]  # a failed save fails no step
    assert_settled(e)
    stats = e.kv_connector.stats()
    assert stats["kv_store_ready_blocks"] == 0  # the stage that failed has nothing: no slot is READY
    flush(e)
    assert run(e, LATER).token_ids == expected["later"]
    assert e.scheduler.stats().num_failed_load_tokens == 0  # nothing was offered that could not load
    assert_settled(e)
    e.close()


@pytest.mark.parametrize("load", ["async", "sync"])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_load_that_hangs_times_out_and_is_recomputed(tiny_hf_dir, expected, pp_size, load):
    """Async: the scheduler's timeout; sync: the worker's own wait (`_wait_load`, found by mutation testing)."""
    options = {"load": load, "load_fault": "hang", "hang_s": 1.5, "fault_pp_rank": pp_size - 1}
    e = engine(tiny_hf_dir, pp_size, options=options, load_timeout_s=0.2)
    run(e, FIRST)
    flush(e)
    assert run(e, LATER).token_ids == expected["later"]
    stats = e.scheduler.stats()
    assert stats.num_external_prefix_hit_tokens == 0 and stats.num_failed_load_tokens > 0
    if load == "async":
        assert e.kv_stats()["num_timed_out_transfers"] == 1
    assert_settled(e)
    e.close()


@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_save_that_hangs_times_out_and_its_blocks_are_freed(tiny_hf_dir, expected, pp_size):
    options = {"save_fault": "hang", "hang_s": 3.0, "fault_pp_rank": 0}
    e = engine(tiny_hf_dir, pp_size, options=options, save_timeout_s=0.2)
    assert run(e, FIRST).token_ids == expected["first"]  # held for its saves, then timed out
    assert e.kv_stats()["num_timed_out_transfers"] == 1
    assert_settled(e)
    assert e.kv_connector.stats()["kv_store_ready_blocks"] == 0  # its saves are not trusted
    e.close()


@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_connector_that_never_reports_is_timed_out(tiny_hf_dir, pp_size):
    """Loads that never finish are recomputed, sends that never finish are dropped: the engine ends."""
    prompts = tiny_prompts(320, 6)
    reference = [c.token_ids for c in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]
    kv = {"options": {"load_blocks": 1}, "load_timeout_s": 0.1, "save_timeout_s": 0.1}
    e = engine(tiny_hf_dir, pp_size, "stuck", **kv)
    assert [c.token_ids for c in e.generate(prompts, GREEDY)] == reference
    stats = e.scheduler.stats()
    assert stats.num_failed_load_tokens > 0 and stats.num_external_prefix_hit_tokens == 0
    num_loads = stats.num_failed_load_tokens // BLOCK
    assert e.kv_stats()["num_timed_out_transfers"] == num_loads + len(prompts)  # every load, every send
    for runner in e.executor.runners:  # every stage was told to stop each of them
        assert len(set(runner.kv_connector.connector.aborted)) == len(prompts)
    assert_settled(e)


def test_ask_again_later_does_not_hold_up_other_requests_and_ends(tiny_hf_dir):
    prompts = tiny_prompts(320, 4)
    asking = [7, *prompts[1]]  # the connector asks to be asked again for prompts starting with 7
    reference = [c.token_ids for c in Engine(tiny_config(tiny_hf_dir)).generate([asking, *prompts], GREEDY)]
    # Its deadline is long beside the others' few steps, so they are surely done before it is computed.
    e = engine(tiny_hf_dir, 1, "stuck", options={"ask_again_token": 7}, load_timeout_s=1.5, save_timeout_s=0.1)
    ids = [e.add_request(p, GREEDY) for p in (asking, *prompts)]
    finished_order, tokens = [], {rid: [] for rid in ids}
    while e.has_unfinished_requests() or e.has_pending_transfers():
        for out in e.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finished_order.append(out.request_id)
    assert [tokens[rid] for rid in ids] == reference
    assert finished_order[-1] == ids[0] and set(finished_order[:-1]) == set(ids[1:])  # the others went first
    assert e.kv_connector.num_asked_again > 1
    assert_settled(e)
