"""ISA levels: what a CPU runs, the flags each level compiles with, torch's caps for a forced level."""

from __future__ import annotations

import pytest

from asyncpp.kernels import build
from asyncpp.kernels.isa import ISA_LEVELS, CpuInfo, compile_flags, cpu_info, resolve_isa, torch_isa_env

AVX2 = ("avx2", "fma", "f16c")
AVX512 = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq")
HASWELL = CpuInfo("Haswell", frozenset(AVX2), "x86_64")
ZEN4 = CpuInfo("Zen 4", frozenset(AVX512 + ("avx512_bf16",)), "x86_64")
SPR = CpuInfo("Sapphire Rapids", frozenset(AVX512 + ("avx512_bf16", "amx_bf16", "amx_tile")), "x86_64")
OLD = CpuInfo("Sandy Bridge", frozenset(("avx", "sse4_2")), "x86_64")
ARM = CpuInfo("Neoverse", frozenset(("asimd",)), "aarch64")


@pytest.mark.parametrize(
    "info,best", [(HASWELL, "avx2"), (ZEN4, "avx512_bf16"), (SPR, "amx"), (OLD, "generic"), (ARM, "generic")]
)
def test_best_level_is_the_highest_whose_every_flag_is_there(info, best):
    assert info.best_level == best
    assert info.supported_levels == ISA_LEVELS[: ISA_LEVELS.index(best) + 1]


def test_a_level_needs_the_levels_below():
    # AVX512-BF16 without AVX-512 F/BW/VL/DQ (never seen, but the rule is the chain)
    odd = CpuInfo("odd", frozenset(AVX2 + ("avx512_bf16",)), "x86_64")
    assert odd.best_level == "avx2" and not odd.supports("avx512_bf16")


def test_resolve_names_the_key_for_unknown_and_missing_levels():
    assert resolve_isa("auto", ZEN4) == "avx512_bf16"
    assert resolve_isa("avx2", ZEN4) == "avx2"
    with pytest.raises(ValueError, match=r"model.cpu_isa must be 'auto' or one of .*got 'sse9'"):
        resolve_isa("sse9", ZEN4)
    with pytest.raises(ValueError, match=r"model.cpu_isa = 'avx512' but this CPU \(Haswell\) runs at most 'avx2'"):
        resolve_isa("avx512", HASWELL)


def test_each_level_compiles_for_exactly_its_instructions():
    generic, avx2, avx512, bf16 = (compile_flags(lv, "x86_64") for lv in ("generic", "avx2", "avx512", "avx512_bf16"))
    assert "-march=native" not in generic + avx2 + avx512 + bf16
    assert "-mavx2" not in generic and "-mfma" in avx2 and "-mavx512f" not in avx2
    assert "-mavx512f" in avx512 and "-mavx512bf16" not in avx512 and "-mavx512bf16" in bf16
    assert compile_flags("amx", "x86_64") == bf16
    assert compile_flags("generic", "aarch64") == ()
    with pytest.raises(ValueError, match="x86-64 only"):
        compile_flags("avx2", "aarch64")


def test_torch_is_capped_only_below_the_best_level():
    assert torch_isa_env("avx512_bf16", ZEN4) == {}
    env = torch_isa_env("avx2", ZEN4)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert torch_isa_env("avx512", SPR)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert torch_isa_env("generic", ARM) == {}


def test_every_level_this_cpu_runs_builds_its_own_library(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCPP_KERNEL_CACHE", str(tmp_path))
    build.load_kernel_library.cache_clear()
    try:
        levels = [lv for lv in cpu_info().supported_levels if lv != "amx"]
        libs = [build.load_kernel_library("argmax", lv) for lv in levels]
        if any(lib is None for lib in libs):
            pytest.skip("no C compiler")
        assert sorted(p.name.split("-")[1] for p in tmp_path.glob("argmax-*.so")) == sorted(levels)
    finally:
        build.load_kernel_library.cache_clear()
