"""`build.compile_checkout`: another checkout's kernel is built with that checkout's own headers."""

from __future__ import annotations

import ctypes

import pytest

from asyncpp.kernels import build

pytestmark = pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")


def test_a_checkout_builds_with_its_own_headers(tmp_path):
    kernels = tmp_path / "tree" / "asyncpp" / "kernels"
    kernels.mkdir(parents=True)
    # cpu_vec.h shadows the package's header of that name; probe.h exists only in the checkout.
    (kernels / "cpu_vec.h").write_text("#define PROBE_BASE 40\n")
    (kernels / "probe.h").write_text("#define PROBE_STEP 2\n")
    (kernels / "probe.c").write_text('#include "cpu_vec.h"\n#include "probe.h"\nint probe(void) { return PROBE_BASE + PROBE_STEP; }\n')
    target = tmp_path / "probe.so"
    build.compile_checkout(tmp_path / "tree", "probe", "generic", target)
    lib = ctypes.CDLL(str(target))
    assert lib.probe() == 42


def test_a_checkout_without_the_kernel_fails(tmp_path):
    (tmp_path / "asyncpp" / "kernels").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):
        build.compile_checkout(tmp_path, "missing", "generic", tmp_path / "missing.so")
