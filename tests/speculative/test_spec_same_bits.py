"""bfloat16 n-gram drafting changes no bit: every row of a verification step whose drafts before it
were right has exactly the logits single-row decoding gives at that position, and the tokens are plain
greedy's. In process (one and two stages), through a prefill/decode pair (the decode engine drafts
after the remote first token), and with drafts capped by `max_model_len`."""

from __future__ import annotations

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config
from tests.kv_transfer.pd.pd_harness import pd_engine, serve_pd
from tests.row_logits import RowRecorder, assert_rows_equal_single_rows
from tests.speculative.test_spec_engine import SPEC, repetitive_prompts
from tests.speculative.test_spec_real_model import REPEAT

BF16 = {"dtype": "bfloat16"}
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def run(config, prompts, params=GREEDY):
    engine = Engine(config)
    try:
        results = engine.generate(prompts, params)
        return [r.token_ids for r in results], engine.stats()
    finally:
        engine.close()


@pytest.mark.parametrize("pp_size", [1, 2])
def test_tiny_bfloat16_verification_rows_equal_single_row_decoding(tiny_hf_dir, monkeypatch, pp_size):
    recorder = RowRecorder(monkeypatch)
    prompts = repetitive_prompts(320)
    plain_tokens, _ = run(tiny_config(tiny_hf_dir, model=BF16, parallel={"pp_size": pp_size}), prompts)
    plain = recorder.take()
    config = tiny_config(tiny_hf_dir, model=BF16, parallel={"pp_size": pp_size}, speculative=SPEC)
    spec_tokens, stats = run(config, prompts)
    spec = recorder.take()
    assert spec_tokens == plain_tokens
    assert stats["spec_decode_num_accepted_tokens"] > 10
    assert assert_rows_equal_single_rows(spec, plain) > 10  # rows verifying accepted drafts


def test_tiny_bfloat16_drafts_capped_by_max_model_len(tiny_hf_dir, monkeypatch):
    """Requests that run right up to `max_model_len` while drafting: the last steps carry fewer drafts,
    never a position past the end, and the tokens and rows stay plain greedy's."""
    recorder = RowRecorder(monkeypatch)
    prompts = repetitive_prompts(320)[::2]  # the repetitive ones: drafts right up to the end
    max_model_len = 96
    params = [SamplingParams(max_tokens=max_model_len - len(p), temperature=0.0, ignore_eos=True) for p in prompts]
    model = {"dtype": "bfloat16", "max_model_len": max_model_len}
    plain_tokens, _ = run(tiny_config(tiny_hf_dir, model=model), prompts, params)
    plain = recorder.take()
    spec_tokens, stats = run(tiny_config(tiny_hf_dir, model=model, speculative=SPEC), prompts, params)
    assert spec_tokens == plain_tokens
    assert [len(p) + len(t) for p, t in zip(prompts, spec_tokens)] == [max_model_len] * len(prompts)
    assert stats["spec_decode_num_accepted_tokens"] > 0
    spec = recorder.take()
    assert all(len(prompt) + len(context) < max_model_len for prompt, context in spec)  # no row past the end
    assert assert_rows_equal_single_rows(spec, plain) > 0
    # Drafts were verified within the last k positions before the end, so the cap bit.
    k = SPEC["num_speculative_tokens"]
    assert any(n > 0 and len(p) + len(c) >= max_model_len - k for (p, c), (n, _) in spec.items())


def test_tiny_bfloat16_drafting_on_the_decode_engine_of_a_pd_pair(tiny_hf_dir, monkeypatch):
    """The decode engine drafts from the prompt and the remote first token on: same tokens and rows as
    one engine without drafts."""
    pytest.importorskip("nixl_cu12")
    recorder = RowRecorder(monkeypatch)
    prompts = repetitive_prompts(320)
    plain_tokens, _ = run(tiny_config(tiny_hf_dir, model=BF16, parallel={"pp_size": 2}), prompts)
    plain = recorder.take()
    producer = pd_engine(tiny_hf_dir, "producer", "prefill", 2, (1, 3), model=BF16)
    consumer = pd_engine(tiny_hf_dir, "consumer", "decode", 1, (), model=BF16, speculative=SPEC)
    try:
        consumer.kv_connector.add_remote_engine(producer.kv_connector.engine_handshake())
        completions = serve_pd(producer, consumer, prompts, GREEDY)
        stats = consumer.stats()
    finally:
        consumer.close()
        producer.close()
    assert [c.token_ids for c in completions] == plain_tokens
    assert stats["spec_decode_num_accepted_tokens"] > 10
    assert assert_rows_equal_single_rows(recorder.take(), plain) > 10


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_bfloat16_verification_rows_equal_single_row_decoding(monkeypatch):
    from asyncpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    config = EngineConfig(
        model=ModelConfig(source="gguf", dtype="bfloat16", max_model_len=512),
        parallel=ParallelConfig(pp_size=2, num_threads=1),
        cache=CacheConfig(kv_cache_memory_mb=32),
    )
    recorder = RowRecorder(monkeypatch)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain_tokens, _ = run(config, REPEAT, params)
    plain = recorder.take()
    spec_tokens, stats = run(config.replace(speculative=SPEC), REPEAT, params)
    assert spec_tokens == plain_tokens
    assert stats["spec_decode_num_accepted_tokens"] > 20
    assert assert_rows_equal_single_rows(recorder.take(), plain) > 20
