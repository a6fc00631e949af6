"""The real SmolLM2 GGUF served with its own Q4_1 / Q8_0 blocks (`weight_format = "native"`).

Greedy output equals `transformers` float32 on the same file (which
dequantizes it), token for token, at pp = 1 and 2; and every ISA level this
CPU runs gives the same tokens (float32 everywhere: the AVX2 and AVX-512 linears compute
the same bits; the generic build rounds its multiply-adds twice). With
AVX512-BF16 native weights also compute in bfloat16: bfloat16 activations times
the file's exact weights, which follows float32 further than the float path's
bfloat16-rounded weights do.
"""

from __future__ import annotations

import pytest
import torch

from asyncpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from asyncpp.engine.engine import Engine
from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.qlinear import qlinear_kernel
from asyncpp.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.skipif(qlinear_kernel() is None, reason="no C compiler"),
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "Explain recursion to a child in two sentences."}],
    [{"role": "user", "content": "Write a python function that reverses a linked list."}],
]
MAX_TOKENS = 32


def native_config(
    pp_size: int = 1, cpu_isa: str = "auto", weight_format: str = "native", dtype: str = "float32"
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(source="gguf", dtype=dtype, weight_format=weight_format, cpu_isa=cpu_isa, max_model_len=512),
        parallel=ParallelConfig(pp_size=pp_size, num_threads=1),
        cache=CacheConfig(kv_cache_memory_mb=64),
    )


def generate(config: EngineConfig):
    engine = Engine(config)
    assert engine.compute_plan.dtype == "float32"
    return engine, engine.generate(CHATS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))


@pytest.fixture(scope="module")
def reference():
    """transformers float32 on the GGUF (dequantized by gguf-py at load): greedy token ids per chat."""
    transformers = pytest.importorskip("transformers")
    from asyncpp.weights import default_gguf_path

    path = default_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    expected = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, ids["input_ids"].shape[1] :].tolist())
    return expected


@pytest.mark.parametrize("pp_size", [1, 2])
def test_native_weights_equal_transformers_float32(reference, pp_size):
    engine, results = generate(native_config(pp_size))
    stats = engine.stats()
    assert stats["weight_format"] == "native" and len(stats["weight_bytes_per_stage"]) == pp_size
    # The Q4_1 / Q8_0 blocks (~97 MB; pp=2 holds the tied Q8_0 embedding twice, once per end),
    # not float32 copies (540 MB).
    assert sum(stats["weight_bytes_per_stage"]) < (110e6 if pp_size == 1 else 140e6)
    for chat, result, expected in zip(CHATS, results, reference):
        assert result.token_ids == expected, (chat, result.text)


def test_isa_levels_give_the_same_tokens():
    levels = [lv for lv in cpu_info().supported_levels if lv != "amx"]
    _, native = generate(native_config(cpu_isa=levels[-1]))
    for level in levels[:-1]:
        _, other = generate(native_config(cpu_isa=level))
        for chat, a, b in zip(CHATS, native, other):
            assert a.token_ids == b.token_ids, (level, chat, a.text, b.text)


def _agreeing_prefix(tokens: list[int], expected: list[int]) -> int:
    """How many tokens equal `expected` before the first difference (or the shorter one's end)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))


def test_native_bfloat16_tracks_float32_longer_than_bfloat16_weights(reference):
    """With AVX512-BF16, native weights compute in bfloat16 on the file's exact weights: the same
    tokens at pp = 1 and 2, and on every chat at least as many tokens equal to transformers float32
    as the float path's bfloat16-rounded weights give (here 8/17/32/8/32 against 8/1/25/8/32)."""
    from asyncpp.kernels.linear_bf16 import bf16_native_kernel

    if bf16_native_kernel() is None:
        pytest.skip("bfloat16 native weights need AVX512-BF16")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = {}
    for weight_format, pp_size in (("native", 1), ("native", 2), ("float", 2)):
        engine = Engine(native_config(pp_size=pp_size, weight_format=weight_format, dtype="bfloat16"))
        results[weight_format, pp_size] = [r.token_ids for r in engine.generate(CHATS, sampling)]
    assert results["native", 1] == results["native", 2]
    native = [_agreeing_prefix(t, e) for t, e in zip(results["native", 2], reference, strict=True)]
    rounded = [_agreeing_prefix(t, e) for t, e in zip(results["float", 2], reference, strict=True)]
    assert all(n >= r for n, r in zip(native, rounded, strict=True)) and sum(native) > sum(rounded), (native, rounded)
