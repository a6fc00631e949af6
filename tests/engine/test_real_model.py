"""The real SmolLM2-135M-Instruct GGUF (float32): greedy output equals `transformers` on the same file."""

from __future__ import annotations

import pytest
import torch

from asyncpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncpp.engine.engine import Engine
from asyncpp.kernels.decode_attention import decode_attention_kernel
from asyncpp.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "Explain recursion to a child in two sentences."}],
]


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2):
    return hf_smollm2


def real_config(pp_size: int = 1) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(source="gguf", dtype="float32", max_model_len=512),
        parallel=ParallelConfig(pp_size=pp_size, num_threads=1),
        cache=CacheConfig(kv_cache_memory_mb=64),
    )


def test_real_model_greedy_equals_transformers(hf_reference):
    tok, model = hf_reference
    engine = Engine(real_config())
    results = engine.generate(CHATS, SamplingParams(max_tokens=24, temperature=0.0))
    for chat, result in zip(CHATS, results):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
        expected = out[0, ids["input_ids"].shape[1] :].tolist()
        assert result.token_ids == expected, (chat, result.text, tok.decode(expected))
        assert result.text == tok.decode(expected, skip_special_tokens=True)
        assert result.num_prompt_tokens == ids["input_ids"].shape[1]


def test_real_model_bfloat16_output_does_not_depend_on_batch_chunks_or_prefix_cache():
    """bfloat16 (the served dtype): greedy tokens are the same batched or alone, fresh or after
    prefix-cache hits, in one prefill or in 16-token chunks (the C attention kernel's guarantee)."""
    if decode_attention_kernel("cpu", torch.bfloat16, 9, 3, 64) is None:
        pytest.skip("no C compiler: the torch attention path rounds differently per path")
    sampling = SamplingParams(max_tokens=24, temperature=0.0)
    model = ModelConfig(source="gguf", dtype="bfloat16", max_model_len=512)
    engine = Engine(
        EngineConfig(model=model, parallel=ParallelConfig(num_threads=1), cache=CacheConfig(kv_cache_memory_mb=64))
    )
    batched = engine.generate(CHATS, sampling)
    alone = [engine.generate([chat], sampling)[0] for chat in CHATS]
    assert all(two.num_cached_tokens > one.num_cached_tokens for one, two in zip(batched, alone))
    chunked_engine = Engine(
        EngineConfig(
            model=model,
            parallel=ParallelConfig(num_threads=1),
            cache=CacheConfig(kv_cache_memory_mb=64, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=16),
        )
    )
    chunked = chunked_engine.generate(CHATS, sampling)
    for chat, one, two, three in zip(CHATS, batched, alone, chunked):
        assert one.token_ids == two.token_ids == three.token_ids, (chat, one.text, two.text, three.text)
