"""The Triton decode-attention kernel (the CUDA path) against a float64 reference.

On CPU it runs under Triton's interpreter in a subprocess (the interpreter is
chosen when a kernel is defined, so it cannot be switched on in this
process); on a GPU the same checks run on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncpp.kernels.triton_attention import dot_fits, has_triton
from tests.kernels.interpreted import run_interpreted
from tests.kernels import triton_attention_checks as checks

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not has_triton(), reason="Triton is not installed")


@needs_triton
def test_interpreted_on_cpu():
    run_interpreted("tests.kernels.triton_attention_checks", len(checks.CHECKS), timeout=600)


@needs_triton
@pytest.mark.cuda
@pytest.mark.parametrize("check", checks.CHECKS, ids=lambda c: c.__name__)
def test_on_cuda(check):
    check("cuda")


def test_dot_where_it_fits():
    """`tl.dot` needs 16 rows and columns: a head_dim or a tile under 16 takes the broadcast products."""
    assert dot_fits("cpu", head_dim=64, tile=64)
    assert dot_fits("cpu", head_dim=9, tile=16)  # padded to 16
    assert not dot_fits("cpu", head_dim=8, tile=64)
    assert not dot_fits("cpu", head_dim=64, tile=8)


@needs_triton
def test_explicit_dot_on_a_shape_it_cannot_take():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = (
        "from asyncpp.kernels.triton_attention import triton_attention_kernel as k; import torch\n"
        "assert k('cpu', torch.float32, 4, 2, 8) is not None\n"
        "try:\n    k('cpu', torch.float32, 4, 2, 8, use_dot=True)\nexcept ValueError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "use_dot needs tiles and head_dim of at least 16" in proc.stdout
