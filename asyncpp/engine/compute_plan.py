"""What a deployment computes with: the CPU's ISA level, the dtype and the weight format.

`resolve_compute_plan(model_config, devices)` turns `model.cpu_isa`,
`model.dtype` ("auto" included) and `model.weight_format` into a frozen
`ComputePlan`, once, at start-up, in the composition root (the launcher or
the in-process `Engine`); everything that builds a model, a KV cache or an
activation ring takes the plan's resolved values, never the config's
"auto". A bad combination is a `ConfigError` naming the key:

- `cpu_isa`: "auto" is the CPU's best level; a level it lacks is an error;
- `dtype = "auto"`: bfloat16 on CUDA; on CPU bfloat16 where the level has
  native bfloat16 dot products (avx512_bf16 and up), else float32 (bfloat16
  matmuls would run on a slow conversion path), with either weight format.
  An explicit dtype is kept, even a slow one;
- `weight_format = "native"` needs a CPU (no CUDA kernel) and float32, or
  bfloat16 at a level with AVX512-BF16 (its kernel multiplies the blocks'
  values in bfloat16 dot products). "auto" is native wherever that holds and its
  kernel builds (a C compiler, kernels not disabled), else float: native is
  as fast or faster at every load measured (docs, "Benchmarks");
- bfloat16 linears on a CPU with AVX512-BF16: the row count from which they
  multiply with float32 FMA instead of vdpbf16ps (the same bits, another
  speed), measured on this CPU or forced by `model.fma_min_rows`
  (`asyncpp.kernels.linear_choice`);
- attention on CPU stages, given the model's heads: vdpbf16ps for bfloat16
  caches at avx512_bf16 and up with head_dim a multiple of 32, float32
  multiplies elsewhere, torch's SDPA where the C kernel does not serve the
  shape or does not build (`asyncpp.kernels.decode_attention.arithmetic`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from asyncpp.config import ConfigError, ModelConfig
from asyncpp.dtypes import torch_dtype
from asyncpp.kernels import decode_attention
from asyncpp.kernels import isa as kernel_isa
from asyncpp.kernels.linear_choice import NOT_APPLICABLE, LinearChoice

# The levels whose dot products take bfloat16 natively, as a reason names them.
_NATIVE_BF16 = {"avx512_bf16": "AVX512-BF16", "amx": "AMX-BF16"}


@dataclass(frozen=True)
class ComputePlan:
    """The resolved compute settings of every stage, and why; plain values, for logs and stats."""

    isa: str  # the level the CPU kernels are built for (one of ISA_LEVELS)
    dtype: str  # "float32" | "bfloat16" | "float16": weights (float format), activations, KV cache
    weight_format: str  # "float" | "native" (resolved)
    reason: str  # one sentence, "<dtype>: why", e.g. "float32: weight_format = native computes in float32"
    cpu_model: str
    cpu_features: dict[str, bool]
    best_isa: str  # the best level this CPU runs
    linears: LinearChoice = field(default=NOT_APPLICABLE)  # bfloat16 linears: vdpbf16ps or float32 FMA by rows
    attention: str = ""  # CPU stages' attention arithmetic ("vdpbf16ps", ...); "" on CUDA or heads not given

    @property
    def fma_min_rows(self) -> tuple[int | None, int | None]:
        """(float weights, GGUF blocks): the rows from which the stages' bfloat16 linears take float32 FMA."""
        return self.linears.float_rows, self.linears.block_rows

    def describe(self) -> dict[str, Any]:
        """The plan as flat fields, for a structlog event or `client.stats()`."""
        return {
            "cpu_model": self.cpu_model,
            "isa": self.isa,
            "best_isa": self.best_isa,
            "dtype": self.dtype,
            "weight_format": self.weight_format,
            "reason": self.reason,
            "cpu_features": dict(self.cpu_features),
            **self.linears.describe(),
            **({"attention": self.attention} if self.attention else {}),
        }

    def summary(self) -> str:
        """One short line: `cpu: avx2 of avx512_bf16; dtype float32: <why>; weights float[; linears ...][; attention ...]`."""
        text = f"cpu: {self.isa} of {self.best_isa}; dtype {self.reason}; weights {self.weight_format}"
        if self.linears is not NOT_APPLICABLE:
            text = f"{text}; {self.linears.summary()}"
        return f"{text}; attention {self.attention}" if self.attention else text


def resolve_compute_plan(
    model: ModelConfig,
    devices: Sequence[str],
    info: kernel_isa.CpuInfo | None = None,
    native_kernel_builds: Callable[[str, str], bool] | None = None,
    choose_linears: Callable[[str, int], LinearChoice] | None = None,
    heads: tuple[int, int, int] | None = None,
    attention_kernel_builds: Callable[[str], bool] | None = None,
) -> ComputePlan:
    """The plan for `model` on the stages' `devices`; `info`: the CPU (default: this machine's);
    `native_kernel_builds(dtype, isa)`: whether native weights' kernel builds here (default: try);
    `choose_linears(isa, model.fma_min_rows)`: the bfloat16 linears' choice (default: measure or cache);
    `heads`: the model's (num_heads, num_kv_heads, head_dim), for the attention's arithmetic on CPU
    (None: not reported); `attention_kernel_builds(isa)`: whether its C kernel builds (default: try)."""
    info = info or kernel_isa.cpu_info()
    try:
        isa = kernel_isa.resolve_isa(model.cpu_isa, info, key="model.cpu_isa")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    on_cuda = any(d.split(":")[0] == "cuda" for d in devices)
    _check_weight_format(model, on_cuda)
    dtype, reason = _choose_dtype(model, isa, info, on_cuda)
    weight_format = model.weight_format
    if weight_format == "auto":
        builds = native_kernel_builds or _native_kernel_builds
        native = not on_cuda and (dtype == "float32" or (dtype == "bfloat16" and kernel_isa.at_least(isa, "avx512_bf16")))
        weight_format = "native" if native and builds(dtype, isa) else "float"
    linears = NOT_APPLICABLE
    if not on_cuda and dtype == "bfloat16" and kernel_isa.at_least(isa, "avx512_bf16") and model.linear_kernel == "auto":
        linears = (choose_linears or _choose_linears)(isa, model.fma_min_rows)
    attention = ""
    if heads is not None and not on_cuda:
        builds = (attention_kernel_builds or decode_attention.kernel_builds)(isa)
        attention = decode_attention.arithmetic(isa, torch_dtype(dtype), *heads, builds=builds)
    return ComputePlan(
        isa=isa,
        dtype=dtype,
        weight_format=weight_format,
        reason=reason,
        cpu_model=info.model_name,
        cpu_features=info.features(),
        best_isa=info.best_level,
        linears=linears,
        attention=attention,
    )


def _choose_linears(isa: str, forced: int) -> LinearChoice:
    """This machine's choice, where its CPU runs the bfloat16 kernel (a made-up CpuInfo does not count)."""
    from asyncpp.kernels.linear_bf16 import bf16_kernel
    from asyncpp.kernels.linear_choice import choose_fma_min_rows

    kernel = bf16_kernel("avx512_bf16") if kernel_isa.cpu_info().supports(isa) else None
    return NOT_APPLICABLE if kernel is None else choose_fma_min_rows(kernel, forced)


def _native_kernel_builds(dtype: str, isa: str) -> bool:
    """Whether the kernel of native weights in `dtype` loads at `isa` (it is built and cached once)."""
    from asyncpp.kernels.linear_bf16 import bf16_native_kernel
    from asyncpp.kernels.qlinear import qlinear_kernel

    return (qlinear_kernel(isa) if dtype == "float32" else bf16_native_kernel(isa)) is not None


def _check_weight_format(model: ModelConfig, on_cuda: bool) -> None:
    if model.weight_format != "native":
        return
    if on_cuda:
        raise ConfigError(
            'model.weight_format = "native" has no CUDA kernel: use weight_format = "float" on CUDA stages'
        )
    if model.dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(
            f'model.weight_format = "native" computes in float32 or bfloat16 but model.dtype is {model.dtype!r}: '
            'set model.dtype = "auto", "float32" or "bfloat16", or model.weight_format = "float"'
        )


def _choose_dtype(model: ModelConfig, isa: str, info: kernel_isa.CpuInfo, on_cuda: bool) -> tuple[str, str]:
    """(dtype, reason) for `model.dtype` at `isa`."""
    native_bf16 = _NATIVE_BF16.get(isa, isa) if kernel_isa.at_least(isa, "avx512_bf16") else None
    if model.weight_format == "native" and model.dtype == "bfloat16" and native_bf16 is None:
        raise ConfigError(
            f'model.weight_format = "native" with model.dtype = "bfloat16" needs AVX512-BF16, but model.cpu_isa '
            f'resolves to {isa!r}: use model.dtype = "auto" or "float32"'
        )
    if model.dtype != "auto":
        if model.dtype == "bfloat16" and not on_cuda and native_bf16 is None:
            return "bfloat16", f"bfloat16: set by model.dtype, though {_no_bf16(isa, info)} (bf16 matmul runs slowly)"
        return model.dtype, f"{model.dtype}: set by model.dtype"
    if on_cuda:
        return "bfloat16", "bfloat16: CUDA computes it natively"
    if native_bf16 is not None:
        return "bfloat16", f"bfloat16: the CPU computes it natively ({native_bf16})"
    return "float32", f"float32: {_no_bf16(isa, info)}; bf16 matmul would run on a slow path"


def _no_bf16(isa: str, info: kernel_isa.CpuInfo) -> str:
    """Why `isa` has no native bfloat16: the CPU lacks it, or the level was forced below it."""
    if info.supports("avx512_bf16"):
        return f"no native bfloat16 at cpu_isa = {isa}"
    return f"no native bfloat16 on this CPU ({isa})"


def compute_stats(plan: ComputePlan, weight_bytes_per_stage: Sequence[int]) -> dict[str, Any]:
    """The plan's fields and each stage's resident weight bytes, as `stats()` reports them."""
    return {**plan.describe(), "weight_bytes_per_stage": [int(n) for n in weight_bytes_per_stage]}
