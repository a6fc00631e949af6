"""When stages call the KV connector (seed 003) and how the engine merges their reports (seeds 000, 001).

In-process engine, tiny model, pp = 1, 2, 3, with the test connectors of
`tests.kv_transfer.connectors`.
"""

from __future__ import annotations

import pytest

import tests.kv_transfer.connectors  # noqa: F401  (registers the test connectors)
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SPLITS = {1: (), 2: (1, 3), 3: (1, 1, 2)}


def engine_with(tiny_hf_dir, pp_size: int, connector: str = "recording", **options) -> Engine:
    kv = {"connector": connector, "module": "tests.kv_transfer.connectors", "options": options}
    parallel = {"pp_size": pp_size, "layer_split": SPLITS[pp_size]}
    return Engine(tiny_config(tiny_hf_dir, parallel=parallel, kv_transfer=kv))


def workers(engine: Engine):
    return [runner.kv_connector.connector for runner in engine.executor.runners]


@pytest.fixture(scope="module")
def reference(tiny_hf_dir):
    engine = Engine(tiny_config(tiny_hf_dir))
    return [c.token_ids for c in engine.generate(tiny_prompts(320, 6), GREEDY)]


@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_every_stage_binds_polls_and_clears_on_every_step(tiny_hf_dir, reference, pp_size):
    # Loads outlast the short requests' decoding: the engine must then poll with empty plans.
    engine = engine_with(tiny_hf_dir, pp_size, load_blocks=1, delay_steps=12)
    # Each stage owns its own layers.
    assert [w.layers for w in workers(engine)] == [list(range(s, e)) for s, e in engine.capacity.layer_ranges]
    out = engine.generate(tiny_prompts(320, 6), GREEDY)
    assert [c.token_ids for c in out] == reference  # loads that fail are recomputed: same tokens
    scheduler_side = engine.kv_connector
    num_steps = len(scheduler_side.plans)
    empty_steps = [p.step_id for p in scheduler_side.plans if not p.scheduled]
    assert empty_steps, "loads pending while nothing can run must still be polled"
    assert len(scheduler_side.outputs) == num_steps  # the merged output reaches the scheduler every step
    for worker in workers(engine):
        assert not worker.has_metadata  # cleared after the last step
        by_step: dict[int, list[str]] = {}
        for event, step_id, _ in worker.events:
            by_step.setdefault(step_id, []).append(event)
        assert sorted(s for s in by_step if s >= 0) == list(range(num_steps))
        for step_id in range(num_steps):
            events = [e for e in by_step[step_id] if e != "reported"]
            has_forward = step_id not in empty_steps
            expected = ["bind", "start_load_kv"]
            expected += ["save_kv", "wait_for_save"] if has_forward else []
            assert events == expected + ["get_finished", "clear"], (worker.pp_rank, step_id, events)


def test_last_stage_samples_then_proposes_then_post_forward(tiny_hf_dir, monkeypatch):
    engine = engine_with(tiny_hf_dir, 2)
    order: list[str] = []
    last = engine.executor.runners[-1]
    sampler = last.sampler

    class RecordingSampler:
        def __call__(self, *args, **kwargs):
            order.append("sample")
            return sampler(*args, **kwargs)

    monkeypatch.setattr(last, "sampler", RecordingSampler())
    monkeypatch.setattr(last, "propose_drafts", lambda state, output: order.append("propose"))
    worker = last.kv_connector.connector
    record = worker.record
    monkeypatch.setattr(worker, "record", lambda event, **kw: (order.append(event), record(event, **kw)))
    engine.generate(tiny_prompts(320, 2), GREEDY)
    steps = "|".join(order).split("|bind|")
    assert len(steps) > 4
    for step in steps[1:]:
        assert step.split("|") == ["start_load_kv", "sample", "propose", "save_kv", "wait_for_save", "get_finished", "clear"]


@pytest.mark.parametrize("pp_size", [2, 3])
def test_load_waits_for_every_stage_and_send_holds_blocks_until_every_stage(tiny_hf_dir, reference, pp_size):
    """Stage k reports a transfer (k + 1) * 2 polls after it starts: the last stage is the last to report."""
    engine = engine_with(tiny_hf_dir, pp_size, "staggered", load_blocks=1, delay_steps=2)
    side = engine.kv_connector
    prompts = tiny_prompts(320, 6)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    held_after_finish: dict[str, list[bool]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests() or engine.has_pending_transfers():
        engine.step()
        for rid in ids:
            if rid in side.finished and rid not in side.finished_sending_at:
                held_after_finish[rid].append(engine.block_manager.has_blocks(rid))
    loaded = [rid for rid in ids if rid in side.finished_recving_at]
    assert loaded, "some prompts are long enough to be offered a load"
    for rid in loaded:
        # Reports of stage k arrive on different steps; the request runs only after the last one.
        recv_step = side.finished_recving_at[rid]
        first_step = side.first_scheduled_at(rid)
        assert first_step is not None and first_step > recv_step
        report_steps = [
            next(step for event, step, fields in w.events if event == "reported" and rid in fields["recving"])
            for w in workers(engine)
        ]
        assert report_steps == sorted(set(report_steps)) and report_steps[-1] == recv_step  # stage by stage
    for rid in ids:
        assert held_after_finish[rid] and all(held_after_finish[rid]), rid  # kept until every stage sent
        assert not engine.block_manager.has_blocks(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.get_request(ids[0]) is None  # forgotten once freed
