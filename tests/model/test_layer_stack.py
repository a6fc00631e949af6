"""The float32 layer stack (one C call for a slice's layers) against the module-by-module forward.

Same kernels, same order: hidden states, residuals and KV caches must be
bit-identical, for a first slice (no residual yet) and a middle one, on a step
that mixes fresh prompts, a later chunk and decodes, at every ISA level.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncpp.kernels.decode_attention import decode_attention_kernel
from asyncpp.kernels.isa import cpu_info
from asyncpp.model.attention import AttentionMetadata
from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.weights import read_arch
from asyncpp.worker.kv_cache import allocate_kv_caches
from asyncpp.worker.stage import build_model_slice

BLOCK_SIZE = 16
LEVELS = [lv for lv in cpu_info().supported_levels if lv != "amx"]


def _step(arch, isa, dtype=torch.float32):
    start_positions = np.array([0, 30, 20, 0, 5])
    num_new_tokens = np.array([12, 1, 9, 33, 1])
    block_table = np.arange(5 * 4).reshape(5, 4)[::-1].copy()
    kernel = decode_attention_kernel("cpu", dtype, arch.num_heads, arch.num_kv_heads, arch.head_dim, isa=isa)
    meta, positions = AttentionMetadata.build(
        start_positions, num_new_tokens, block_table, BLOCK_SIZE, "cpu", dtype, decode_kernel=kernel
    )
    return meta, torch.from_numpy(positions), int(num_new_tokens.sum())


def _caches(model, seed):
    arch = model.arch
    caches = allocate_kv_caches(model.num_layers, 20, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for k, v in caches:  # earlier context of the requests that have one
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return caches


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("start,end", [(0, 2), (1, 3)])
def test_stack_is_bit_identical_to_modules(isa, start, end):
    name = "tiny-llama-6l"
    arch = read_arch("random", name)
    model = build_model_slice("random", name, arch, start, end, torch.float32, "cpu", isa=isa)
    if model.stack is None:
        pytest.skip("layer stack unavailable (no C compiler)")
    meta, positions, num_tokens = _step(arch, isa)
    ids = torch.randint(0, arch.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1))
    inputs = None
    if start > 0:
        g = torch.Generator().manual_seed(2)
        inputs = IntermediateTensors(
            {k: torch.randn(num_tokens, arch.hidden_size, generator=g) for k in ("hidden_states", "residual")}
        )
    stack = model.stack
    results = []
    for use_stack in (True, False):
        model.use_layer_stack(stack if use_stack else None)
        caches = _caches(model, seed=3)
        kept = None if inputs is None else IntermediateTensors({k: inputs[k].clone() for k in inputs.keys()})
        out = model(ids if start == 0 else None, positions, caches, meta, inputs)
        if inputs is not None:
            assert all(torch.equal(kept[k], inputs[k]) for k in kept.keys()), "inputs must not be modified"
        results.append((out, caches))
    (a, caches_a), (b, caches_b) = results
    for key in ("hidden_states", "residual"):
        assert torch.equal(a[key], b[key]), key
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_bfloat16_stack_over_gguf_blocks_is_bit_identical(tmp_path, qtype):
    if "avx512_bf16" not in LEVELS:
        pytest.skip("bfloat16 native weights need AVX512-BF16")
    from tests.weights.weights_helpers import GGUF_ARCH, Q, random_hf_tensors, write_llama_gguf

    arch = GGUF_ARCH
    tensors = {n: t * (0.05 if t.ndim == 2 else 1.0) for n, t in random_hf_tensors(arch, seed=5).items()}
    path = str(write_llama_gguf(tmp_path / "m.gguf", arch, tensors, getattr(Q, qtype)))
    model = build_model_slice("gguf", path, arch, 0, 1, torch.bfloat16, "cpu", weight_format="native")
    assert model.stack is not None and model.stack.dtype == torch.bfloat16
    meta, positions, num_tokens = _step(arch, "avx512_bf16", torch.bfloat16)
    ids = torch.randint(0, arch.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1))
    stack, results = model.stack, []
    for use_stack in (True, False):
        model.use_layer_stack(stack if use_stack else None)
        caches = [(k.bfloat16(), v.bfloat16()) for k, v in _caches(model, seed=3)]
        results.append((model(ids, positions, caches, meta), caches))
    (a, caches_a), (b, caches_b) = results
    assert all(torch.equal(a[key], b[key]) for key in ("hidden_states", "residual"))
    assert all(torch.equal(x, y) for pa, pb in zip(caches_a, caches_b) for x, y in zip(pa, pb))


def test_no_stack_without_native_linears():
    arch = read_arch("random", "tiny-llama")
    bf16 = build_model_slice("random", "tiny-llama", arch, 0, 2, torch.bfloat16, "cpu")
    assert bf16.stack is None  # float weights in bfloat16: the oneDNN / linear_bf16 modules
    onednn = build_model_slice("random", "tiny-llama", arch, 0, 2, torch.float32, "cpu", linear_kernel="onednn")
    assert onednn.stack is None
