"""The Triton fused ops (the CUDA path of `fused_ops`) against the model's unfused torch code and float64.

On CPU they run under Triton's interpreter in a subprocess (the interpreter is
chosen when a kernel is defined, so it cannot be switched on in this
process); on a GPU the same checks run on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

from asyncpp.kernels.fused_ops import CFusedOps, fused_ops
from asyncpp.kernels.triton_attention import has_triton
from asyncpp.kernels.triton_fused import TritonFusedOps, triton_fused_ops
from tests.kernels.interpreted import run_interpreted
from tests.kernels import triton_fused_checks as checks

needs_triton = pytest.mark.skipif(not has_triton(), reason="Triton is not installed")


@needs_triton
def test_interpreted_on_cpu():
    run_interpreted("tests.kernels.triton_fused_checks", len(checks.CHECKS), timeout=300)


@needs_triton
@pytest.mark.cuda
@pytest.mark.parametrize("check", checks.CHECKS, ids=lambda c: c.__name__)
def test_on_cuda(check):
    check("cuda")


@needs_triton
@pytest.mark.cuda
def test_cuda_devices_get_the_triton_ops():
    for dtype in checks.DTYPES:
        ops = fused_ops("cuda", dtype)
        assert isinstance(ops, TritonFusedOps) and ops.dtype == dtype
    assert fused_ops("cuda", torch.float64) is None


def test_cpu_keeps_the_c_ops():
    for dtype in (torch.bfloat16, torch.float32):
        ops = fused_ops("cpu", dtype)
        assert ops is None or isinstance(ops, CFusedOps)  # None only without a C compiler
    assert fused_ops("cpu", torch.float16) is None


def test_no_triton_ops_off_cuda_without_the_interpreter():
    """Building the ops needs no GPU and compiles nothing: kernels are built at first use, here never."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs Triton kernels on any device")
    assert triton_fused_ops("cpu", torch.bfloat16) is None
    assert triton_fused_ops("meta", torch.float32) is None
    assert triton_fused_ops("cuda", torch.float64) is None
    assert fused_ops("meta", torch.bfloat16) is None
