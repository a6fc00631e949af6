"""`weight_format = "native"`: GGUF blocks kept as stored, rows un-permuted, models built on them.

A model slice over native weights computes what the float32 model over the
dequantized weights computes (within float32 rounding; both go through the
same batch-invariant kernel family), the tied head shares the embedding's
packed bytes, and a type with no kernel fails naming the tensor.
"""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from asyncpp.kernels.qlinear import qlinear_kernel
from asyncpp.model.native_linear import NativeEmbedding, NativeLinear
from asyncpp.weights import load_weights, read_arch
from asyncpp.weights.base import EMBED_NAME, LM_HEAD_NAME, StoredTensor
from asyncpp.worker.stage import build_model_slice

from weights_helpers import GGUF_ARCH, Q, random_hf_tensors, to_gguf_layout, write_llama_gguf

pytestmark = pytest.mark.skipif(qlinear_kernel() is None, reason="no C compiler")


def _gguf(tmp_path, qtype, tied=False, raw=None):
    arch = dataclasses.replace(GGUF_ARCH, tie_word_embeddings=tied)
    tensors = random_hf_tensors(arch, seed=int(qtype))
    for name in tensors:  # weights of a trained model's scale, so activations stay moderate
        if tensors[name].ndim == 2:
            tensors[name] *= 0.05
        else:
            tensors[name] = 1.0 + 0.1 * tensors[name]
    if tied:
        tensors.pop(LM_HEAD_NAME, None)
    return write_llama_gguf(tmp_path / f"m-{qtype.name}.gguf", arch, tensors, qtype, raw=raw)


def _native(path, start=0, end=2, head=True):
    return load_weights("gguf", str(path), start_layer=start, end_layer=end, need_embed=start == 0, need_head=head, native=True)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32], ids=lambda q: q.name)
def test_stored_tensors_dequantize_to_the_float_loader(tmp_path, qtype):
    path = _gguf(tmp_path, qtype)
    native = _native(path)
    floats = load_weights("gguf", str(path), start_layer=0, end_layer=2, need_embed=True, need_head=True)
    kernel = qlinear_kernel()
    for name, value in native.items():
        if isinstance(value, StoredTensor):
            assert value.format == qtype.name.lower() and value.shape == tuple(floats[name].shape)
            packed = kernel.pack(value.format, value.rows, *value.shape)
            rows = kernel.dequant_rows(value.format, packed, value.shape[1], torch.arange(value.shape[0]))
            assert torch.equal(rows, floats[name]), name  # q/k un-permuted exactly like the float path
        else:
            assert value.dim() == 1 and torch.equal(value, floats[name])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("tied", [False, True])
def test_native_model_equals_float32_on_dequantized_weights(tmp_path, qtype, tied):
    path = _gguf(tmp_path, qtype, tied=tied)
    arch = read_arch("gguf", str(path))
    native = build_model_slice("gguf", str(path), arch, 0, 2, torch.float32, "cpu", weight_format="native")
    floats = build_model_slice("gguf", str(path), arch, 0, 2, torch.float32, "cpu", weight_format="float")
    head = native.lm_head.head  # inside the float32-logits rows it reuses (`asyncpp.model.logits_head`)
    assert isinstance(head, NativeLinear) and isinstance(native.embed_tokens, NativeEmbedding)
    assert head.runs[0][0] == qtype.name.lower()
    if tied:  # one packed copy serves the embedding lookup and the head
        assert native.embed_tokens.packed is head.runs[0][1]
        assert floats.embed_tokens.packed is floats.lm_head.head.runs[0][1]
    assert native.weight_nbytes() < floats.weight_nbytes() or qtype == Q.F32
    ids = torch.tensor([3, 7, 11, 0, 39, 5, 5, 12])
    emb_native, emb_float = native.embed_tokens(ids), floats.embed_tokens(ids)
    assert torch.equal(emb_native, emb_float)
    x = torch.randn(5, arch.hidden_size)
    for name in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj", "lm_head.head"):
        a, b = native.get_submodule(name), floats.get_submodule(name)
        xin = x if a.in_features == arch.hidden_size else torch.randn(5, a.in_features)
        torch.testing.assert_close(a(xin), b(xin), rtol=1e-4, atol=1e-4)  # outputs ~1: float32 rounding


def test_mixed_formats_in_one_layer(tmp_path):
    """q/k in Q4_1 and v in Q8_0 (as some llama.cpp mixes store them): one layer, two packed runs."""
    arch = GGUF_ARCH
    tensors = random_hf_tensors(arch, seed=3)
    v_name = "model.layers.0.self_attn.v_proj.weight"
    v = to_gguf_layout(arch, v_name, tensors[v_name] * 0.05)
    path = write_llama_gguf(tmp_path / "mixed.gguf", arch, tensors, Q.Q4_1, raw={v_name: (gguf.quants.quantize(v, Q.Q8_0), Q.Q8_0)})
    model = build_model_slice("gguf", str(path), arch, 0, 1, torch.float32, "cpu", weight_format="native")
    floats = build_model_slice("gguf", str(path), arch, 0, 1, torch.float32, "cpu", weight_format="float")
    qkv = model.layers[0].self_attn.qkv_proj
    assert [fmt for fmt, _, _ in qkv.runs] == ["q4_1", "q8_0"]
    x = torch.randn(3, arch.hidden_size)
    torch.testing.assert_close(qkv(x), floats.layers[0].self_attn.qkv_proj(x), rtol=1e-4, atol=1e-4)


def test_type_without_kernel_names_the_tensor(tmp_path):
    path = _gguf(tmp_path, Q.Q5_0)
    arch = read_arch("gguf", str(path))
    with pytest.raises(ValueError, match=r"token_embd\.weight.*Q5_0.*model\.weight_format"):
        build_model_slice("gguf", str(path), arch, 0, 1, torch.float32, "cpu", weight_format="native")


def test_native_needs_float32_or_bfloat16_on_cpu(tmp_path):
    path = _gguf(tmp_path, Q.Q8_0)
    arch = read_arch("gguf", str(path))
    with pytest.raises(ValueError, match="float32 or bfloat16 on CPU"):
        build_model_slice("gguf", str(path), arch, 0, 1, torch.float16, "cpu", weight_format="native")
    with pytest.raises(ValueError, match="bfloat16 needs AVX512-BF16"):
        build_model_slice("gguf", str(path), arch, 0, 1, torch.bfloat16, "cpu", isa="avx2", weight_format="native")


def test_float_sources_are_stored_as_f32():
    name = "tiny-llama"
    arch = read_arch("random", name)
    tensors = load_weights("random", name, start_layer=0, end_layer=1, need_embed=True, need_head=False, native=True)
    assert isinstance(tensors[EMBED_NAME], StoredTensor) and tensors[EMBED_NAME].format == "f32"
    floats = load_weights("random", name, start_layer=0, end_layer=1, need_embed=True, need_head=False)
    stored = tensors[EMBED_NAME]
    assert torch.equal(stored.rows.view(torch.float32).reshape(stored.shape), floats[EMBED_NAME])
    assert arch.hidden_size == stored.shape[1]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16], ids=lambda q: q.name)
def test_bfloat16_native_linears(tmp_path, qtype):
    """In bfloat16, GGUF blocks multiply the bfloat16 inputs by the file's exact weights: the float32
    model's product on those inputs up to one bfloat16 rounding, closer to it than the float path's
    bfloat16-rounded weights. Float formats (F16) are rounded to bfloat16 like the float path: the
    same bits."""
    from asyncpp.kernels.linear_bf16 import bf16_native_kernel

    if bf16_native_kernel() is None:
        pytest.skip("bfloat16 native weights need AVX512-BF16")
    path = _gguf(tmp_path, qtype, tied=True)
    arch = read_arch("gguf", str(path))
    native = build_model_slice("gguf", str(path), arch, 0, 2, torch.bfloat16, "cpu", weight_format="native")
    floats = build_model_slice("gguf", str(path), arch, 0, 2, torch.bfloat16, "cpu", weight_format="float")
    exact = build_model_slice("gguf", str(path), arch, 0, 2, torch.float32, "cpu", weight_format="native")
    head = native.lm_head.head
    assert isinstance(head, NativeLinear) and native.embed_tokens.packed is head.runs[0][1]
    assert native.weight_nbytes() < floats.weight_nbytes()
    ids = torch.tensor([3, 7, 11, 0, 39, 5])
    assert torch.equal(native.embed_tokens(ids), floats.embed_tokens(ids))
    for rows in (1, 3, 9):
        x = torch.randn(rows, arch.hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for name in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj", "lm_head"):
            y, y_float = native.get_submodule(name)(x), floats.get_submodule(name)(x)
            if qtype == Q.F16:
                assert torch.equal(y, y_float), (name, rows)
                continue
            ref = exact.get_submodule(name)(x.float()).double()
            torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-5, msg=(name, rows))
            assert (y.double() - ref).abs().mean() < (y_float.double() - ref).abs().mean(), (name, rows)