"""A randomized run of the offload connector: aborts, preemptions, failing and hanging transfers, timeouts.

Many requests share a few long prefixes (so the store serves loads), in a
cache small enough to preempt; a seeded share of the saves and loads on
every stage raise (and loads also hang past their deadline), and random
requests are aborted mid-way. Afterwards nothing may be held, pending,
pinned or owed, and every request that was not aborted must equal, token
for token, the same prompt served by an engine without a connector.
"""

from __future__ import annotations

import random

import pytest

import tests.kv_transfer.faults  # noqa: F401  (registers the connectors)
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config
from tests.kv_transfer.test_transfer_faults import assert_settled

BLOCK = 16


def workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    # Six prefixes of 5-8 blocks do not all fit in the 24-block cache: the store serves them back.
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.choice((80, 96, 128)))] for _ in range(6)]
    requests = []
    for _ in range(32):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_tokens=rng.randrange(2, 20), temperature=0.0, ignore_eos=True)
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize("pp_size,seed", [(1, 1), (2, 2), (2, 3)])
def test_random_faults_leave_nothing_held_and_outputs_exact(tiny_hf_dir, pp_size, seed):
    requests = workload(seed)
    plain = Engine(tiny_config(tiny_hf_dir))
    reference = [c.token_ids for c in plain.generate([p for p, _ in requests], [sp for _, sp in requests])]
    # Saves only raise: a hung save holds up the transfer thread, so whether the saves behind it beat
    # their deadline (and the store has anything to load later) would depend on the machine's speed.
    options = {"save_fault": "raise", "load_fault": "raise|hang", "fault_rate": 0.1, "hang_s": 0.3, "seed": seed}
    e = Engine(
        tiny_config(
            tiny_hf_dir,
            parallel={"pp_size": pp_size, "layer_split": (1, 3) if pp_size == 2 else ()},
            cache={"num_kv_blocks_override": 24},  # a few requests at a time: preemptions
            scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64},
            kv_transfer={
                "connector": "faulty", "module": "tests.kv_transfer.faults", "store_size_mb": 1,
                "load_timeout_s": 0.2, "save_timeout_s": 0.2, "options": options,
            },
        )
    )  # fmt: skip
    rng = random.Random(seed)
    pending = list(enumerate(requests))
    ids: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    while pending or e.has_unfinished_requests() or e.has_pending_transfers():
        for _ in range(rng.randrange(0, 3)):  # arrivals in small waves
            if pending:
                index, (prompt, params) = pending.pop(0)
                rid = e.add_request(prompt, params)
                ids[rid], tokens[rid] = index, []
        live = [rid for rid in ids if rid not in aborted and e.scheduler.get_request(rid) is not None]
        if live and rng.random() < 0.04:
            rid = rng.choice(live)
            e.abort(rid)
            aborted.add(rid)
        for out in e.step():
            tokens[out.request_id] += out.token_ids
            assert out.finish_reason != "error", out.error  # transfer faults never fail a request
    assert_settled(e)
    for rid, index in ids.items():
        if rid not in aborted:
            assert tokens[rid] == reference[index], (rid, index)
    stats = e.scheduler.stats()  # what the run went through
    assert stats.num_preemptions > 0 and aborted
    assert stats.num_external_prefix_hit_tokens + stats.num_failed_load_tokens > 0  # the store was loaded from
    assert sum(r.kv_connector.connector.num_faults for r in e.executor.runners) > 0
    e.close()
