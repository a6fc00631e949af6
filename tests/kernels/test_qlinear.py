"""qlinear: float32 linears over stored-format weights, at every ISA level this CPU runs.

Each format is checked against a float64 product with the dequantized weight
(gguf's own quantizer and dequantizer), on odd shapes and 1 to 512 rows; a
row's result must not depend on its batch, nor (AVX2 vs AVX-512) on the level.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.qlinear import BLOCK_FORMATS, FORMATS, qlinear_kernel

Q = gguf.GGMLQuantizationType
LEVELS = [lv for lv in cpu_info().supported_levels if lv != "amx"]  # amx builds the C kernels like avx512_bf16
# (rows, out_features, in_features): a GEMV, sizes off every tile / panel / 64-column boundary, 512 rows;
# 40 rows x 10 blocks: the many-row path with a last run of blocks shorter than the others (GEMM_KC = 8).
SHAPES = [
    (1, 64, 32), (2, 17, 64), (5, 100, 96), (13, 333, 160), (1, 576, 576), (40, 50, 320), (64, 200, 1536),
    (512, 70, 64),
]  # fmt: skip


@pytest.fixture(scope="module", params=LEVELS)
def kernel(request):
    k = qlinear_kernel(request.param)
    if k is None:
        pytest.skip("qlinear kernel unavailable (no C compiler)")
    return k


def stored(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight as stored: GGUF rows or a float tensor, its dequantized float32 values)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if fmt == "f32":
        return torch.from_numpy(w), torch.from_numpy(w)
    if fmt == "f16":
        h = torch.from_numpy(w).half()
        return h, h.float()
    if fmt == "bf16":
        b = torch.from_numpy(w).bfloat16()
        return b, b.float()
    qtype = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}[fmt]
    raw = gguf.quants.quantize(w, qtype)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within float32 rounding of the float64 result, relative to sum |x| |w| per output."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = ((y.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert err < 1e-5, err


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_float64_and_is_batch_invariant(kernel, fmt, m, n, k):
    if fmt not in BLOCK_FORMATS:
        k += 1  # float formats take any input size
    raw, w = stored(fmt, n, k, seed=m * 1000 + n)
    packed = kernel.pack(fmt, raw, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    y = kernel.linear(fmt, x, packed, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    check_close(y, x, w)
    rows = [0, m // 2, m - 1]
    alone = torch.cat([kernel.linear(fmt, x[i : i + 1], packed, n) for i in rows])
    assert torch.equal(alone, y[rows]), "a row's output depends on its batch"
    if m > 3:
        assert torch.equal(kernel.linear(fmt, x[1:4], packed, n), y[1:4])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequant_rows_equal_gguf(kernel, fmt):
    n, k = 50, 96
    raw, w = stored(fmt, n, k, seed=7)
    packed = kernel.pack(fmt, raw, n, k)
    ids = torch.tensor([0, 49, 17, 16, 17])
    assert torch.equal(kernel.dequant_rows(fmt, packed, k, ids), w[ids])


def test_strided_input_and_output_slice(kernel):
    raw, w = stored("q4_1", 64, 64, seed=3)
    packed = kernel.pack("q4_1", raw, 64, 64)
    x = torch.randn(6, 128)[:, ::2]  # not contiguous in its last dimension
    wide = torch.full((6, 100), 7.0)
    kernel.linear("q4_1", x, packed, 64, out=wide[:, 20:84])
    assert torch.equal(wide[:, 20:84], kernel.linear("q4_1", x.contiguous(), packed, 64))
    assert (wide[:, :20] == 7).all() and (wide[:, 84:] == 7).all()


def test_multithreaded_equals_one_thread(kernel):
    raw, _ = stored("q4_1", 300, 256, seed=5)
    packed = kernel.pack("q4_1", raw, 300, 256)
    x = torch.randn(40, 256)
    one = kernel.linear("q4_1", x, packed, 300)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(kernel.linear("q4_1", x, packed, 300), one)
    finally:
        torch.set_num_threads(previous)


def test_avx2_and_avx512_give_the_same_bits():
    if not {"avx2", "avx512"} <= set(LEVELS):
        pytest.skip("needs a CPU that runs both AVX2 and AVX-512")
    a, b = qlinear_kernel("avx2"), qlinear_kernel("avx512")
    for fmt in FORMATS:
        raw, _ = stored(fmt, 130, 192, seed=11)
        pa, pb = a.pack(fmt, raw, 130, 192), b.pack(fmt, raw, 130, 192)
        # different tiles at each level (AVX-512: 3 and 6 rows x 4 groups, 9 and 12 rows in one tile, 40 = 10 x 4)
        for m in (1, 3, 6, 9, 12, 40, 100):
            x = torch.randn(m, 192)
            assert torch.equal(a.linear(fmt, x, pa, 130), b.linear(fmt, x, pb, 130)), (fmt, m)


def test_bad_inputs_are_refused(kernel):
    with pytest.raises(ValueError, match="no kernel for weight format 'q6_k'"):
        kernel.pack("q6_k", torch.zeros(4, 10, dtype=torch.uint8), 4, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.pack("q4_1", torch.zeros(4, 10, dtype=torch.uint8), 4, 40)
    with pytest.raises(ValueError, match="not 10 bytes"):
        kernel.pack("q4_1", torch.zeros(4, 10, dtype=torch.uint8), 4, 64)
    raw, _ = stored("q8_0", 16, 32, seed=1)
    packed = kernel.pack("q8_0", raw, 16, 32)
    with pytest.raises(TypeError, match="float32 activations"):
        kernel.linear("q8_0", torch.zeros(1, 32, dtype=torch.bfloat16), packed, 16)
