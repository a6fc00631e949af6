"""The AVX512-BF16 linear kernel: batch invariant, thread invariant, and close to a float32 matmul."""

from __future__ import annotations

import pytest
import torch

from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.linear_bf16 import linear_bf16_kernel
from asyncpp.model.packed_linear import KernelLinear, pack_linear_layers

BF16 = torch.bfloat16

# SmolLM2-135M's qkv, o, gate+up and down projections and lm_head (cut to 4096 rows), then
# shapes that leave partial blocks and panels (out % 64, out % 16) and an odd in_features.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576), (100, 64), (37, 33), (7, 1)]


@pytest.fixture(scope="module")
def kernel():
    # Asked for at `avx512_bf16` whatever the machine's own level: an AMX CPU (level `amx`) has
    # AVX512-BF16 too, and runs this same kernel in production through `bf16_native_kernel`.
    if not cpu_info().supports("avx512_bf16"):
        pytest.skip("linear_bf16 needs AVX512-BF16")
    k = linear_bf16_kernel("cpu", BF16, isa="avx512_bf16")
    if k is None:
        pytest.skip("linear_bf16 kernel unavailable (no C compiler)")
    return k


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _case(shape, rows, seed=0):
    g = torch.Generator().manual_seed(seed + shape[0] * 7 + shape[1])
    weight = (0.05 * torch.randn(shape, generator=g)).to(BF16)
    x = torch.randn(rows, shape[1], generator=g).to(BF16)
    return weight, x


def test_only_bfloat16_on_cpu():
    assert linear_bf16_kernel("cpu", torch.float32) is None
    assert linear_bf16_kernel("meta", BF16) is None


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_close_to_a_float32_matmul(kernel, shape):
    weight, x = _case(shape, 50)
    y = kernel.linear(x, kernel.pack(weight), shape[0])
    ref = x.float() @ weight.float().T
    assert y.dtype == BF16 and y.shape == (50, shape[0])
    # one bfloat16 rounding of the result (2^-8 relative) plus float32 summation noise
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-4 * shape[1] ** 0.5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_do_not_depend_on_the_batch_or_threads(kernel, threads, shape):
    """200 rows cross the 96-row chunk and every tile size (1-6 rows) is exercised below."""
    weight, x = _case(shape, 200, seed=1)
    packed = kernel.pack(weight)
    torch.set_num_threads(1)
    whole = kernel.linear(x, packed, shape[0])
    torch.set_num_threads(threads)
    for rows in (1, 2, 3, 5, 7, 13, 16, 64, 97):
        batched = torch.cat([kernel.linear(x[s : s + rows], packed, shape[0]) for s in range(0, x.shape[0], rows)])
        differing = int((batched != whole).any(dim=1).sum())
        assert differing == 0, f"{differing} rows change when computed {rows} at a time with {threads} threads"


def test_strided_rows_and_leading_dims(kernel):
    weight, x = _case((192, 576), 12)
    layer = KernelLinear(weight, kernel)
    wide = torch.zeros(12, 700, dtype=BF16)
    wide[:, 100:676] = x
    view = wide[:, 100:676]  # row stride 700, not contiguous
    assert torch.equal(layer(view), layer(x))
    assert torch.equal(layer(x.view(3, 4, 576)), layer(x).view(3, 4, 192))


def test_pack_linear_layers_uses_the_kernel(kernel):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 64, bias=True)).to(BF16)
    x = torch.randn(5, 64).to(BF16)
    weight = model[0].weight.detach().clone()
    assert pack_linear_layers(model, kernel) == 1  # layers with a bias stay plain
    assert isinstance(model[0], KernelLinear) and isinstance(model[1], torch.nn.Linear)
    assert torch.equal(model[0](x), kernel.linear(x, kernel.pack(weight), 32))


def _gguf_case(fmt, out_features, in_features, seed):
    """A random weight quantized to `fmt`: (GGUF rows, GGUF's float32 dequantization)."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    deq = gguf.quants.dequantize(raw, qtype).reshape(out_features, in_features).astype(np.float32)
    return torch.from_numpy(raw), torch.from_numpy(deq)


GGUF_SHAPES = [(960, 576), (100, 64), (37, 96), (70, 1536)]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 64, 97, 512])
def test_gguf_blocks_equal_bfloat16_inputs_times_the_exact_weights(kernel, fmt, rows):
    """Blocks: the float64 product of the bfloat16 inputs and GGUF's dequantized weights (not rounded
    to bfloat16), up to float32 summation noise and the output's one bfloat16 rounding."""
    for out_features, in_features in GGUF_SHAPES:
        raw, deq = _gguf_case(fmt, out_features, in_features, seed=rows + out_features)
        packed = kernel.pack_blocks(fmt, raw, out_features, in_features)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(BF16)
        y = kernel.linear_blocks(fmt, x, packed, out_features).double()
        ref = x.double() @ deq.double().T
        magnitude = x.double().abs() @ deq.double().abs().T
        excess = (y - ref).abs() - 2**-8 * ref.abs()  # beyond half a bfloat16 ulp of the result (2^-8 relative)
        assert bool((excess <= 1e-6 * magnitude + 1e-30).all()), (out_features, in_features, float(excess.max()))
        # Exact weights are closer to the float32 product than the float path's bfloat16-rounded ones.
        rounded = kernel.linear(x, kernel.pack(deq.to(BF16)), out_features).double()
        assert (y - ref).abs().mean() < (rounded - ref).abs().mean(), (out_features, in_features)
        ids = torch.tensor([0, out_features - 1, out_features // 2])
        assert torch.equal(kernel.dequant_rows_blocks(fmt, packed, in_features, ids), deq[ids])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_block_rows_do_not_depend_on_the_batch_or_threads(kernel, threads, fmt):
    """Every tile shape (streaming, Q4: 1-8 rows, Q8_0: 1-16, 1 to 4 panels at once, acc in registers
    or memory; Q4 batches of 9-96 rows: streaming tiles of 5-6 rows, acc in registers; Q8_0 batches of
    17-64: streaming tiles of up to 16; more rows: a BLOCK expanded once, tiles of 4-6 rows) and thread
    count gives a row the same bits (the 100 rows at once take the expanded path for every format)."""
    for out_features, in_features in GGUF_SHAPES:
        raw, _ = _gguf_case(fmt, out_features, in_features, seed=out_features)
        packed = kernel.pack_blocks(fmt, raw, out_features, in_features)
        x = torch.randn(100, in_features, generator=torch.Generator().manual_seed(7)).to(BF16)
        torch.set_num_threads(1)
        whole = kernel.linear_blocks(fmt, x, packed, out_features)
        torch.set_num_threads(threads)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 33, 48, 96):
            batched = torch.cat([kernel.linear_blocks(fmt, x[s : s + rows], packed, out_features) for s in range(0, 100, rows)])
            differing = int((batched != whole).any(dim=1).sum())
            assert differing == 0, f"{differing} rows change {rows} at a time, {threads} threads, {out_features}x{in_features}"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_gguf_many_rows_in_one_call_keep_their_bits(kernel, threads, fmt):
    """300 rows in one call (50 expanded tiles, each over the BLOCK's panels two at a time), with a long
    k (1536 inputs, 48 scale steps per output) and a short one (96): a row keeps the bits it gets in a
    batch of 1, 17, 129 or 200."""
    for out_features, in_features in [(70, 1536), (100, 96)]:
        raw, _ = _gguf_case(fmt, out_features, in_features, seed=in_features)
        packed = kernel.pack_blocks(fmt, raw, out_features, in_features)
        x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(3)).to(BF16)
        whole = kernel.linear_blocks(fmt, x, packed, out_features)
        for rows in (1, 17, 129, 200):
            batched = torch.cat([kernel.linear_blocks(fmt, x[s : s + rows], packed, out_features) for s in range(0, 300, rows)])
            differing = int((batched != whole).any(dim=1).sum())
            assert differing == 0, f"{differing} rows change {rows} at a time, {threads} threads, {out_features}x{in_features}"


def test_gguf_blocks_refuse_what_they_cannot_serve(kernel):
    with pytest.raises(ValueError, match="no kernel for q5_0"):
        kernel.pack_blocks("q5_0", torch.zeros(4, 22, dtype=torch.uint8), 4, 32)
    with pytest.raises(ValueError, match="q4_1 weights of 40 inputs"):
        kernel.pack_blocks("q4_1", torch.zeros(4, 25, dtype=torch.uint8), 4, 40)


def test_an_amx_cpu_runs_this_kernel_for_stored_weights(kernel):
    from asyncpp.kernels.linear_bf16 import bf16_native_kernel

    assert bf16_native_kernel("amx") is not None  # what production picks at level `amx`
    assert linear_bf16_kernel("cpu", BF16, isa="amx") is None  # dense bf16 weights go to oneDNN there
