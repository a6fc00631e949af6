"""Early handover: the decode engine is given a request while the prefill engine computes its
prompt, reads the prompt's KV as soon as each prefill stage has it, and goes on once the prefill's
first token comes. Greedy output equals one engine's, every block comes back, faults fail alone."""

from __future__ import annotations

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.kv_transfer.pd.pd_harness import assert_idle, pd_pair_early, serve_pd_early

pytest.importorskip("nixl_cu12")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PAIRS = [
    ((1, ()), (1, ())),
    ((2, (1, 3)), (3, (2, 1, 1))),
    ((3, (1, 1, 2)), (1, ())),
    ((2, (3, 1)), (2, (1, 3))),
]


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(300, 8) + [[(5 * i) % 290 + 7 for i in range(100)]]


@pytest.fixture(scope="module")
def expected(tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir))
    try:
        return [c.token_ids for c in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()


@pytest.mark.parametrize("prefill_side,decode_side", PAIRS, ids=lambda p: f"pp{p[0]}")
def test_early_handover_greedy_output_equals_one_engine(tiny_hf_dir, prompts, expected, prefill_side, decode_side):
    producer, consumer = pd_pair_early(tiny_hf_dir, *prefill_side, *decode_side)
    try:
        completions = serve_pd_early(producer, consumer, prompts, GREEDY)
        assert [c.error for c in completions] == [None] * len(prompts)
        assert [c.token_ids for c in completions] == expected
        stats = consumer.kv_connector.stats()
        assert stats["pd_num_pulls"] == len(prompts)
        assert stats["pd_num_pulled_tokens"] == sum(len(p) for p in prompts)
        assert consumer.stats()["kv_num_handovers"] == len(prompts)
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()
