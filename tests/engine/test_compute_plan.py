"""`resolve_compute_plan`: ISA level, dtype "auto" and weight format, on made-up CPUs; the in-process engine uses it."""

from __future__ import annotations

import pytest

from asyncpp.config import ConfigError, ModelConfig
from asyncpp.dtypes import torch_dtype
from asyncpp.engine.compute_plan import ComputePlan, compute_stats, resolve_compute_plan
from asyncpp.engine.engine import Engine
from asyncpp.kernels import isa
from asyncpp.kernels.isa import CpuInfo
from asyncpp.kernels.linear_choice import NOT_APPLICABLE, LinearChoice
from asyncpp.weights import read_arch
from tests.conftest import tiny_config

AVX2 = ("avx2", "fma", "f16c")
AVX512 = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq")
AVX2_ONLY = CpuInfo("Intel(R) Core(TM) i7-4770", frozenset(("sse4_2",) + AVX2), "x86_64")
SKYLAKE = CpuInfo("Intel(R) Xeon(R) Gold 6148", frozenset(AVX512), "x86_64")
ZEN4 = CpuInfo("AMD EPYC 9R14", frozenset(AVX512 + ("avx512_bf16",)), "x86_64")
SAPPHIRE = CpuInfo("Intel(R) Xeon(R) Platinum 8480+", frozenset(AVX512 + ("avx512_bf16", "amx_bf16", "amx_tile")), "x86_64")
ARM = CpuInfo("Neoverse-V1", frozenset({"asimd", "bf16"}), "aarch64")
CPU = ("cpu", "cpu")


CHOSEN = LinearChoice(16, 32, "measured", "float32 FMA from 16 rows (made up)")


def plan_for(info: CpuInfo, devices=CPU, builds: bool = True, **model) -> ComputePlan:
    asked = []

    def choose(level: str, forced: int) -> LinearChoice:
        asked.append((level, forced))
        return CHOSEN

    plan = resolve_compute_plan(ModelConfig(**model), devices, info, lambda dtype, level: builds, choose)
    assert len(asked) == (plan.linears is CHOSEN)  # asked once where it applies, never elsewhere
    assert all(a == (plan.isa, ModelConfig(**model).fma_min_rows) for a in asked)
    return plan


@pytest.mark.parametrize("info", [ZEN4, SAPPHIRE])
def test_bfloat16_cpu_linears_choose_their_fma_rows_once(info):
    plan = plan_for(info, fma_min_rows=8)
    assert plan.linears is CHOSEN and plan.fma_min_rows == (32, 16)  # (float weights, GGUF blocks)
    assert plan.summary().endswith("; linears float32 FMA from 16 rows (made up)")


@pytest.mark.parametrize(
    "info,devices,model",
    [
        (ZEN4, CPU, {"dtype": "float32"}),
        (ZEN4, CPU, {"linear_kernel": "onednn"}),
        (ZEN4, CPU, {"cpu_isa": "avx512"}),
        (AVX2_ONLY, CPU, {}),
        (ZEN4, ("cuda:0",), {"device": "cuda"}),
    ],
)
def test_no_linear_choice_where_the_bfloat16_kernel_does_not_run(info, devices, model):
    plan = plan_for(info, devices, **model)
    assert plan.linears is NOT_APPLICABLE and plan.fma_min_rows == (None, None)
    assert "linears" not in plan.summary()


def test_auto_is_bfloat16_where_the_cpu_computes_it_natively():
    plan = plan_for(ZEN4)
    assert (plan.isa, plan.best_isa, plan.dtype, plan.weight_format) == ("avx512_bf16", "avx512_bf16", "bfloat16", "native")
    assert plan.reason == "bfloat16: the CPU computes it natively (AVX512-BF16)"
    assert plan.cpu_model == "AMD EPYC 9R14" and plan.cpu_features["avx512_bf16"] and not plan.cpu_features["amx_bf16"]
    amx = plan_for(SAPPHIRE)
    assert (amx.isa, amx.dtype) == ("amx", "bfloat16") and "AMX-BF16" in amx.reason


@pytest.mark.parametrize("info,level", [(AVX2_ONLY, "avx2"), (SKYLAKE, "avx512"), (ARM, "generic")])
def test_auto_is_float32_without_native_bfloat16(info, level):
    plan = plan_for(info)
    assert (plan.isa, plan.best_isa, plan.dtype) == (level, level, "float32")
    assert plan.reason == f"float32: no native bfloat16 on this CPU ({level}); bf16 matmul would run on a slow path"


def test_a_forced_lower_level_decides_the_dtype_and_says_so():
    plan = plan_for(ZEN4, cpu_isa="avx2")
    assert (plan.isa, plan.best_isa, plan.dtype) == ("avx2", "avx512_bf16", "float32")
    assert plan.reason == "float32: no native bfloat16 at cpu_isa = avx2; bf16 matmul would run on a slow path"
    assert plan.summary().startswith("cpu: avx2 of avx512_bf16; dtype float32: no native bfloat16 at cpu_isa = avx2")
    assert plan.summary().endswith("; weights native")
    assert plan_for(SAPPHIRE, cpu_isa="avx512_bf16").dtype == "bfloat16"
    assert plan_for(ZEN4, cpu_isa="generic").isa == "generic"


def test_auto_weights_are_native_where_a_kernel_serves_them():
    assert plan_for(AVX2_ONLY).weight_format == "native"  # float32
    assert plan_for(ZEN4, cpu_isa="avx2").weight_format == "native"
    assert plan_for(AVX2_ONLY, dtype="bfloat16").weight_format == "float"  # no bf16 block kernel below AVX512-BF16
    assert plan_for(ZEN4, dtype="float16").weight_format == "float"
    assert plan_for(ZEN4, ("cuda:0",), device="cuda").weight_format == "float"
    assert plan_for(ZEN4, builds=False).weight_format == "float"  # no C compiler, or kernels disabled
    assert plan_for(ZEN4, weight_format="float").weight_format == "float"


def test_explicit_dtypes_are_kept_even_slow_ones():
    slow = plan_for(ZEN4, cpu_isa="avx2", dtype="bfloat16")
    assert (slow.isa, slow.dtype) == ("avx2", "bfloat16") and "slow" in slow.reason
    assert plan_for(AVX2_ONLY, dtype="bfloat16").dtype == "bfloat16"
    assert plan_for(ZEN4, dtype="float32").reason == "float32: set by model.dtype"
    assert plan_for(ZEN4, dtype="float16").dtype == "float16"


@pytest.mark.parametrize("info,level", [(AVX2_ONLY, "avx512"), (ZEN4, "amx"), (ARM, "avx2"), (SKYLAKE, "avx512_bf16")])
def test_a_level_the_cpu_lacks_names_the_key(info, level):
    with pytest.raises(ConfigError, match=rf"model.cpu_isa = '{level}' but this CPU \(.+\) runs at most '"):
        plan_for(info, cpu_isa=level)


def test_native_weights_compute_in_bfloat16_where_native_else_float32():
    plan = plan_for(ZEN4, weight_format="native")
    assert (plan.dtype, plan.weight_format) == ("bfloat16", "native")
    assert plan_for(AVX2_ONLY, weight_format="native").dtype == "float32"
    assert plan_for(ZEN4, weight_format="native", cpu_isa="avx2").dtype == "float32"
    assert plan_for(ZEN4, weight_format="native", dtype="float32").dtype == "float32"
    assert plan_for(ZEN4, weight_format="native", dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"model.weight_format = \"native\".*model.dtype is") as info:
        plan_for(ZEN4, weight_format="native", dtype="float16")
    assert "model.dtype" in str(info.value) and "model.weight_format" in str(info.value)
    with pytest.raises(ConfigError, match=r"native.*bfloat16.*needs AVX512-BF16.*model.cpu_isa"):
        plan_for(AVX2_ONLY, weight_format="native", dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"model.weight_format = \"native\" has no CUDA kernel"):
        plan_for(ZEN4, ("cuda:0", "cuda:1"), weight_format="native", device="cuda")


def test_auto_is_bfloat16_on_cuda_whatever_the_cpu():
    plan = plan_for(AVX2_ONLY, ("cuda:0",), device="cuda")
    assert (plan.dtype, plan.isa) == ("bfloat16", "avx2") and "CUDA" in plan.reason
    assert plan_for(AVX2_ONLY, ("cuda",), device="cuda", dtype="float32").dtype == "float32"


def test_describe_and_stats_are_flat_plain_values():
    plan = plan_for(ZEN4)
    fields = plan.describe()
    assert set(fields) == {
        "cpu_model", "isa", "best_isa", "dtype", "weight_format", "reason", "cpu_features",
        "fma_min_rows_blocks", "fma_min_rows_float", "linear_choice", "linear_reason",
    }  # fmt: skip
    assert (fields["fma_min_rows_blocks"], fields["fma_min_rows_float"], fields["linear_choice"]) == (16, 32, "measured")
    assert fields["cpu_features"] == ZEN4.features() and fields["cpu_features"] is not plan.cpu_features
    stats = compute_stats(plan, [1000, 2000])
    assert stats == {**fields, "weight_bytes_per_stage": [1000, 2000]}


def test_this_machine_is_the_default_cpu():
    plan = resolve_compute_plan(ModelConfig(), ("cpu",))
    assert plan.best_isa == isa.cpu_info().best_level and plan.isa == plan.best_isa
    assert plan.dtype in ("bfloat16", "float32") and plan.cpu_model == isa.cpu_info().model_name


def test_in_process_engine_sizes_and_builds_with_the_resolved_dtype(tiny_hf_dir):
    config = tiny_config(tiny_hf_dir, model={"dtype": "auto"})
    heads = read_arch(config.model.source, config.model.path_or_none).heads
    plan = resolve_compute_plan(config.model, config.stage_devices, heads=heads)
    engine = Engine(config)
    try:
        assert engine.compute_plan == plan and plan.attention  # the in-process engine names its attention too
        kv_cache = engine.executor.runners[0].kv_caches[0][0]
        assert kv_cache.dtype == torch_dtype(plan.dtype)
        out = engine.generate([[5, 6, 7]])[0]
        assert out.finish_reason is not None
        stats = engine.stats()
    finally:
        engine.close()
    assert {k: stats[k] for k in plan.describe()} == plan.describe()
    assert len(stats["weight_bytes_per_stage"]) == 1 and stats["weight_bytes_per_stage"][0] > 0
    assert all(type(n) is int for n in stats["weight_bytes_per_stage"])
    assert stats["num_kv_blocks"] > 0 and stats["num_running"] == 0


def test_in_process_engine_refuses_a_level_the_cpu_lacks(tiny_hf_dir, monkeypatch):
    monkeypatch.setattr(isa, "cpu_info", lambda: AVX2_ONLY)
    with pytest.raises(ConfigError, match="model.cpu_isa = 'avx512'"):
        Engine(tiny_config(tiny_hf_dir, model={"cpu_isa": "avx512"}))
    with pytest.raises(ConfigError, match="model.dtype"):
        Engine(tiny_config(tiny_hf_dir, model={"weight_format": "native", "dtype": "bfloat16"}))


SMOLLM2_HEADS = (9, 3, 64)


@pytest.mark.parametrize(
    ("info", "model", "heads", "builds", "expected"),
    [
        (ZEN4, {}, SMOLLM2_HEADS, True, "vdpbf16ps"),  # bfloat16 caches at avx512_bf16
        (SAPPHIRE, {}, SMOLLM2_HEADS, True, "vdpbf16ps"),  # and above
        (ZEN4, {}, (6, 2, 48), True, "float32 multiplies of widened bfloat16"),  # head_dim not a multiple of 32
        (ZEN4, {"cpu_isa": "avx512", "dtype": "bfloat16"}, SMOLLM2_HEADS, True, "float32 multiplies of widened bfloat16"),
        (ZEN4, {"dtype": "float32"}, SMOLLM2_HEADS, True, "float32 multiplies"),
        (AVX2_ONLY, {}, SMOLLM2_HEADS, True, "float32 multiplies"),  # auto: float32 below AVX512-BF16
        (ZEN4, {}, (6, 2, 40), True, "torch SDPA"),  # head_dim not a multiple of 16: the kernel does not serve it
        (ZEN4, {}, SMOLLM2_HEADS, False, "torch SDPA"),  # the kernel does not build here
    ],
)
def test_the_plan_names_the_attention_arithmetic_of_the_cpu_stages(info, model, heads, builds, expected):
    asked = []

    def attention_builds(level: str) -> bool:
        asked.append(level)
        return builds

    plan = resolve_compute_plan(ModelConfig(**model), CPU, info, lambda dtype, level: True, lambda level, forced: CHOSEN,
                                heads=heads, attention_kernel_builds=attention_builds)
    assert asked == [plan.isa]
    assert plan.attention == expected
    assert plan.describe()["attention"] == expected
    assert plan.summary().endswith(f"; attention {expected}")


def test_no_attention_is_reported_on_cuda_or_without_the_heads():
    cuda = resolve_compute_plan(ModelConfig(), ("cuda:0",), ZEN4, lambda dtype, level: True, heads=SMOLLM2_HEADS,
                                attention_kernel_builds=lambda level: pytest.fail("asked on CUDA"))
    assert cuda.attention == "" and "attention" not in cuda.describe() and "attention" not in cuda.summary()
    assert plan_for(ZEN4).attention == ""


def test_the_native_kernel_is_asked_to_build_for_the_plans_dtype_and_level():
    asked = []
    plan = resolve_compute_plan(ModelConfig(), CPU, ZEN4, lambda dtype, level: asked.append((dtype, level)) or True,
                                lambda level, forced: CHOSEN)
    assert asked == [("bfloat16", "avx512_bf16")] and plan.weight_format == "native"
