"""The row-wise argmax kernel: the same indices as torch (first maximum, NaN largest) in every case."""

from __future__ import annotations

import pytest
import torch

from asyncpp.kernels import argmax as argmax_module
from asyncpp.kernels.argmax import argmax_rows
from asyncpp.kernels.build import load_kernel_library
from asyncpp.kernels.isa import cpu_info, native_level

# Around the kernel's main loop (4 sets of 4, 8 or 16 lanes: 16, 32 or 64 elements by level) and its
# lane sets, and the real vocabulary.
LENGTHS = [1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 49152]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if load_kernel_library("argmax", native_level()) is None:
        pytest.skip("argmax kernel unavailable (no C compiler)")


def _rows(n: int, dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + n)
    x = torch.randn(9, n, generator=g)
    if kind == "ties":  # few distinct values: the maximum repeats, often across lanes
        x = (2 * x).round()
    elif kind == "nan":
        x[torch.rand(9, n, generator=g) < 0.02] = float("nan")
    elif kind == "all_nan":
        x[:] = float("nan")
    elif kind == "neg_inf":
        x[:] = float("-inf")
    elif kind == "inf":
        x[:, 1::3] = float("inf")
    elif kind == "late_max":  # the maximum only in the tail, past the vector loop
        x[:, -1] = 100.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "all_nan", "neg_inf", "inf", "late_max"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("isa", [lv for lv in cpu_info().supported_levels if lv != "amx"])
def test_same_as_torch(n, kind, dtype, isa):
    for seed in range(3):
        x = _rows(n, dtype, kind, seed)
        got = argmax_rows(x, isa)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.max(dim=-1).indices)
        assert torch.equal(got, x.argmax(dim=-1))


def test_strided_rows_and_columns():
    base = torch.randn(12, 300).to(torch.bfloat16)
    rows = base[::3, 10:210]  # row stride 900, contiguous columns
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    cols = base.t()[:, ::2]  # non-contiguous last dimension: copied first
    assert torch.equal(argmax_rows(cols), cols.argmax(dim=-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_rows(threads):
    x = _rows(49152, torch.bfloat16, "ties", 7).repeat(8, 1)  # 72 rows: several threads' worth
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def test_other_dtypes_and_shapes_fall_back_to_torch(monkeypatch):
    calls = []
    real = argmax_module._library
    monkeypatch.setattr(argmax_module, "_library", lambda isa: calls.append(1) or real(isa))
    half = torch.randn(3, 50).half()
    assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
    assert not calls  # float16: not the kernel's
    x = torch.randn(4, 100)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert calls  # float32: the kernel
    empty = torch.empty(0, 10)
    assert argmax_rows(empty).shape == (0,)
