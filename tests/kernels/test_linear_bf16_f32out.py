"""The AVX512-BF16 linears with float32 outputs (a model's logits): the very sums the bfloat16 outputs
round, for every tile shape, batch and thread count."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_linear_bf16 import BF16, GGUF_SHAPES, SHAPES, _case, _gguf_case, kernel, threads  # noqa: F401

ROWS = (1, 2, 3, 5, 7, 9, 13, 16, 17, 33, 97)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_float_weights_float32_outputs_are_the_sums_the_bfloat16_ones_round(kernel, threads, shape):
    weight, x = _case(shape, 100, seed=3)
    packed = kernel.pack(weight)
    rounded = kernel.linear(x, packed, shape[0])
    sums = kernel.linear(x, packed, shape[0], out_dtype=torch.float32)
    assert sums.dtype == torch.float32 and torch.equal(sums.to(BF16), rounded)
    assert not torch.equal(sums, rounded.float())  # the bits below bfloat16's are kept
    for rows in ROWS:
        batched = torch.cat([kernel.linear(x[s : s + rows], packed, shape[0], out_dtype=torch.float32) for s in range(0, 100, rows)])
        assert torch.equal(batched, sums), f"{rows} rows at a time, {threads} threads"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_float32_outputs_are_the_sums_the_bfloat16_ones_round(kernel, threads, fmt):
    for out_features, in_features in GGUF_SHAPES:
        raw, _ = _gguf_case(fmt, out_features, in_features, seed=out_features + 1)
        packed = kernel.pack_blocks(fmt, raw, out_features, in_features)
        x = torch.randn(100, in_features, generator=torch.Generator().manual_seed(5)).to(BF16)
        rounded = kernel.linear_blocks(fmt, x, packed, out_features)
        sums = kernel.linear_blocks(fmt, x, packed, out_features, out_dtype=torch.float32)
        assert sums.dtype == torch.float32 and torch.equal(sums.to(BF16), rounded)
        for rows in ROWS:
            batched = torch.cat(
                [kernel.linear_blocks(fmt, x[s : s + rows], packed, out_features, out_dtype=torch.float32) for s in range(0, 100, rows)]
            )
            assert torch.equal(batched, sums), f"{rows} rows at a time, {threads} threads, {out_features}x{in_features}"


def test_float32_outputs_into_a_column_slice(kernel):
    raw, _ = _gguf_case("q8_0", 100, 64, seed=9)
    packed = kernel.pack_blocks("q8_0", raw, 100, 64)
    x = torch.randn(6, 64).to(BF16)
    wide = torch.full((6, 130), -1.0)
    kernel.linear_blocks("q8_0", x, packed, 100, out=wide[:, 10:110])
    assert torch.equal(wide[:, 10:110], kernel.linear_blocks("q8_0", x, packed, 100, out_dtype=torch.float32))
    assert bool((wide[:, :10] == -1).all() and (wide[:, 110:] == -1).all())  # the tail mask wrote nothing past column 100


def test_outputs_must_be_bfloat16_or_float32_rows(kernel):
    weight, x = _case((64, 64), 4)
    packed = kernel.pack(weight)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernel.linear(x, packed, 64, out=torch.empty(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernel.linear(x, packed, 64, out=torch.empty(64, 4).t())
