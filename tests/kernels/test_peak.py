"""One core's ceilings: instruction families measured where the CPU has them, None elsewhere; the fractions."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from asyncpp.bench.peak import kernel_fractions
from asyncpp.kernels.isa import CpuInfo, cpu_info
from asyncpp.kernels.peak import FAMILIES, instruction_rates, read_gbps


def test_each_family_the_cpu_has_is_measured_and_plausible():
    info = cpu_info()
    rates = instruction_rates(info, seconds_each=0.005, tries=1)
    assert set(rates) == {f.name for f in FAMILIES}
    for family in FAMILIES:
        has = info.is_x86 and all(flag in info.flags for flag in family.flags)
        rate = rates[family.name]
        if not has:
            assert rate is None, family.name
            continue
        # a core at 0.5-6 GHz issuing 0.25-4 such instructions a cycle
        assert rate is not None and math.isfinite(rate), family.name
        assert 0.5 * 0.25 * family.macs <= rate <= 6 * 4 * family.macs, (family.name, rate)


def test_families_the_cpu_lacks_are_none():
    bare = CpuInfo("bare", frozenset({"sse2"}), "x86_64")
    assert instruction_rates(bare, seconds_each=0.001, tries=1) == {f.name: None for f in FAMILIES}
    arm = CpuInfo("arm", frozenset({"avx2", "fma", "avx512f"}), "aarch64")  # flags, but not x86
    assert instruction_rates(arm, seconds_each=0.001, tries=1) == {f.name: None for f in FAMILIES}


def test_read_bandwidth_is_plausible():
    gbps = read_gbps(nbytes=32 << 20, tries=1)
    assert gbps is not None and 0.5 < gbps < 500


def test_fractions_of_the_ceilings():
    result = {"gmacs": 60.0, "weights_gbps": 9.0}
    rates = {"fma256 f32": 40.0, "fma512 f32": 80.0, "vdpbf16ps": 41.0, "vpdpbusd zmm (VNNI)": 120.0, "x": None}
    fr = kernel_fractions(result, rates, memcpy=6.0, read=12.0)
    assert fr == {"of_best": 0.5, "of_exact": 0.75, "of_fma": 0.75, "of_memcpy": 1.5, "of_read": 0.75}
    bf16 = kernel_fractions(result, {**rates, "vdpbf16ps": 100.0}, memcpy=6.0, read=12.0)
    assert (bf16["of_best"], bf16["of_exact"], bf16["of_fma"]) == (0.5, 0.6, 0.75)
    two = kernel_fractions(result, rates, memcpy=6.0, read=12.0, threads=2)
    assert (two["of_best"], two["of_fma"], two["of_memcpy"]) == (0.25, 0.375, 1.5)
    avx2 = kernel_fractions(result, {"fma256 f32": 30.0, "fma512 f32": None}, memcpy=None, read=None)
    assert avx2 == {"of_best": 2.0, "of_exact": 2.0, "of_fma": 2.0, "of_memcpy": None, "of_read": None}
    nothing = kernel_fractions(result, {"fma512 f32": None}, memcpy=6.0, read=None)
    assert nothing == {"of_best": None, "of_exact": None, "of_fma": None, "of_memcpy": 1.5, "of_read": None}


def test_the_benchmark_has_a_help():
    out = subprocess.run([sys.executable, "-m", "asyncpp.bench.peak", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--rows" in out.stdout
