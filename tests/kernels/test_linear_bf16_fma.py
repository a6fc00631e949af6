"""The bfloat16 kernel's float32 FMA path: vdpbf16ps's bits to the last one, so rows may switch paths by count."""

from __future__ import annotations

import pytest
import torch

from asyncpp.kernels.linear_choice import PROBE_EXPONENTS, _wide_bf16
from tests.kernels.test_linear_bf16 import _gguf_case, kernel, threads  # noqa: F401 (fixtures)

BF16 = torch.bfloat16
FORMATS = ["q8_0", "q4_0", "q4_1", "float"]
# Partial BLOCKs (out % 64) and panels (out % 16); block formats need in % 32 == 0, floats take any (odd too).
SHAPES = {"blocks": [(100, 64), (37, 96), (70, 1536)], "float": [(100, 64), (37, 33), (70, 1536)]}
ROWS = 512


@pytest.fixture(autouse=True)
def restore_fma_min_rows(kernel):
    before = kernel.fma_min_rows()
    yield
    kernel.set_fma_min_rows(*before)


def _weights(kernel, fmt: str, shape: tuple[int, int], exponents: tuple[int, int] | None = None):
    """(run(x, out_dtype), float64 weight): the packed weight of `fmt` and its exact values; float weights
    of random bits with biased `exponents` in that range, if given."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features * 31 + in_features)
    if fmt == "float":
        w = (0.05 * torch.randn(shape, generator=gen)).to(BF16)
        if exponents is not None:
            w = _wide_bf16(out_features, in_features, gen, exponents)
        packed = kernel.pack(w)
        return (lambda x, dt: kernel.linear(x, packed, out_features, out_dtype=dt)), w.double()
    raw, deq = _gguf_case(fmt, out_features, in_features, seed=out_features)
    packed = kernel.pack_blocks(fmt, raw, out_features, in_features)
    return (lambda x, dt: kernel.linear_blocks(fmt, x, packed, out_features, out_dtype=dt)), deq.double()


def _on_path(kernel, fma_from: int | None, run, x, out_dtype):
    kernel.set_fma_min_rows(fma_from, fma_from)
    return run(x, out_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == BF16 else torch.int32)


@pytest.mark.parametrize("out_dtype", [BF16, torch.float32], ids=["bf16out", "f32out"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fma_rows_equal_dpbf16_rows_bit_for_bit_and_the_float64_product(kernel, threads, fmt, out_dtype):
    for shape in SHAPES["float" if fmt == "float" else "blocks"]:
        run, w = _weights(kernel, fmt, shape)
        x = torch.randn(ROWS, shape[1], generator=torch.Generator().manual_seed(shape[0])).to(BF16)
        dpbf16 = _on_path(kernel, None, run, x, out_dtype)
        fma = _on_path(kernel, 1, run, x, out_dtype)
        assert torch.equal(_bits(fma), _bits(dpbf16)), (fmt, shape, int((fma != dpbf16).sum()))
        ref = x.double() @ w.T
        magnitude = x.double().abs() @ w.abs().T
        rounding = 2**-8 if out_dtype == BF16 else 0.0  # the output's one bfloat16 rounding
        excess = (fma.double() - ref).abs() - rounding * ref.abs()
        assert bool((excess <= 1e-6 * magnitude + 1e-30).all()), (fmt, shape, float(excess.max()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_that_flush_and_cancel_give_the_same_bits_on_both_paths(kernel, fmt):
    """Inputs over the whole exponent range, denormals among them: vdpbf16ps flushes them (and denormal
    sums) to zero, the FMA path must too (MXCSR DAZ | FTZ), and the block steps after it agree."""
    for x_exp, w_exp in zip(PROBE_EXPONENTS["x"], PROBE_EXPONENTS["w"]):
        for shape in SHAPES["float" if fmt == "float" else "blocks"]:
            run, _ = _weights(kernel, fmt, shape, w_exp)
            x = _wide_bf16(40, shape[1], torch.Generator().manual_seed(shape[1]), x_exp)
            for out_dtype in (BF16, torch.float32):
                dpbf16 = _on_path(kernel, None, run, x, out_dtype)
                fma = _on_path(kernel, 1, run, x, out_dtype)
                assert torch.equal(_bits(fma), _bits(dpbf16)), (fmt, shape, x_exp, out_dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_keeps_its_bits_when_its_batch_crosses_fma_min_rows(kernel, threads, fmt):
    """FMA from 16 rows: batches of 1-15 rows stream through vdpbf16ps, 16 and more take FMA; a row's bits
    are the same in every batch."""
    shape = SHAPES["float" if fmt == "float" else "blocks"][1]
    run, _ = _weights(kernel, fmt, shape)
    x = torch.randn(100, shape[1], generator=torch.Generator().manual_seed(3)).to(BF16)
    whole = _on_path(kernel, None, run, x, BF16)
    kernel.set_fma_min_rows(16, 16)
    assert kernel.fma_min_rows() == (16, 16)
    for rows in (1, 7, 15, 16, 17, 33, 100):
        batched = torch.cat([run(x[s : s + rows], BF16) for s in range(0, 100, rows)])
        assert torch.equal(_bits(batched), _bits(whole)), (fmt, rows)


def test_fma_min_rows_reads_back_and_nonpositive_means_never(kernel):
    kernel.set_fma_min_rows(8, None)
    assert kernel.fma_min_rows() == (8, None)
    kernel.set_fma_min_rows(0, 24)
    assert kernel.fma_min_rows() == (None, 24)
