"""What the CPU computes with: its vector ISA level, found once, and the compiler flags per level.

Levels, each a superset of the one before (on x86-64):

- `generic`: portable C (GCC vector extensions lowered to whatever the
  target has; SSE2 on x86-64, NEON or plain scalar elsewhere);
- `avx2`: AVX2 + FMA + F16C (Haswell, Zen 1-3, Intel client CPUs since Alder Lake);
- `avx512`: AVX-512 F/BW/VL/DQ (Skylake-SP, Ice Lake, Zen 4);
- `avx512_bf16`: plus AVX512-BF16 dot products (Cooper Lake, Zen 4);
- `amx`: plus AMX-BF16 tiles (Sapphire Rapids), which oneDNN uses for bf16 matmuls.

`model.cpu_isa = "auto"` takes the best level the CPU runs; a lower level
can be forced, so that a machine with AVX-512 runs (and tests) the AVX2
kernels. Every kernel is compiled per level (`compile_flags`), with the
level in its build-cache key, and chooses its code path from the compiler's
macros (`__AVX2__`, `__AVX512F__`, ...), so a level's library never holds an
instruction of a higher level.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")

# /proc/cpuinfo flags each x86 level needs on top of the level below it.
_LEVEL_FLAGS = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
}
# gcc/clang flags per level; -mtune=native only schedules for this CPU, it adds no instructions.
_X86_FLAGS = {
    "generic": ("-march=x86-64",),
    "avx2": ("-march=x86-64", "-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
}
_X86_FLAGS["avx512_bf16"] = _X86_FLAGS["avx512"] + ("-mavx512bf16",)
_X86_FLAGS["amx"] = _X86_FLAGS["avx512_bf16"]  # the C kernels use no AMX; the level tells torch's oneDNN
_X86_MACHINES = ("x86_64", "amd64", "AMD64")  # platform.machine() on x86-64 (Linux, BSD, Windows)


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's model name, its feature flags (as /proc/cpuinfo spells them) and machine type."""

    model_name: str
    flags: frozenset[str]
    machine: str

    @property
    def is_x86(self) -> bool:
        return self.machine in _X86_MACHINES

    def supports(self, level: str) -> bool:
        """Whether this CPU runs every instruction of `level`."""
        if level not in ISA_LEVELS:
            raise ValueError(f"unknown ISA level {level!r}; known: {', '.join(ISA_LEVELS)}")
        if level == "generic":
            return True
        if not self.is_x86:
            return False
        needed = ISA_LEVELS[1 : ISA_LEVELS.index(level) + 1]
        return all(flag in self.flags for lv in needed for flag in _LEVEL_FLAGS[lv])

    @property
    def best_level(self) -> str:
        return max((lv for lv in ISA_LEVELS if self.supports(lv)), key=ISA_LEVELS.index)

    @property
    def supported_levels(self) -> tuple[str, ...]:
        return tuple(lv for lv in ISA_LEVELS if self.supports(lv))

    def features(self) -> dict[str, bool]:
        """The features that decide asyncpp's kernels, for logs and stats."""
        names = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
        return {name: name in self.flags for name in names}


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU, read once from /proc/cpuinfo (elsewhere: the generic level only)."""
    model_name, flags = platform.processor() or "unknown", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model_name in ("unknown", "", platform.machine()):
                    model_name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value
    except OSError:
        pass
    return CpuInfo(model_name=model_name, flags=frozenset(flags.split()), machine=platform.machine())


def resolve_isa(requested: str, info: CpuInfo | None = None, key: str = "model.cpu_isa") -> str:
    """`requested` ("auto" or a level) -> the level to run; a level this CPU lacks is a ValueError naming `key`."""
    info = info or cpu_info()
    if requested == "auto":
        return info.best_level
    if requested not in ISA_LEVELS:
        raise ValueError(f"{key} must be 'auto' or one of {', '.join(ISA_LEVELS)}, got {requested!r}")
    if not info.supports(requested):
        raise ValueError(
            f"{key} = {requested!r} but this CPU ({info.model_name}) runs at most {info.best_level!r}"
            f" (levels it runs: {', '.join(info.supported_levels)})"
        )
    return requested


def native_level() -> str:
    """The best level this CPU runs: what a kernel is built for when no level is given."""
    return cpu_info().best_level


def at_least(level: str, minimum: str) -> bool:
    return ISA_LEVELS.index(level) >= ISA_LEVELS.index(minimum)


def compile_flags(level: str, machine: str | None = None) -> tuple[str, ...]:
    """Compiler flags that target exactly `level` on this machine type."""
    machine = machine or platform.machine()
    if level not in ISA_LEVELS:
        raise ValueError(f"unknown ISA level {level!r}")
    if machine in _X86_MACHINES:
        return _X86_FLAGS[level] + ("-mtune=native",)
    if level != "generic":
        raise ValueError(f"ISA level {level!r} is x86-64 only (this machine is {machine})")
    return ()


def torch_isa_env(level: str, info: CpuInfo | None = None) -> dict[str, str]:
    """Environment that caps torch's own kernels (ATen, oneDNN, MKL) at `level`, for a process
    started with it: empty at the CPU's best level. Only takes effect before torch is imported."""
    info = info or cpu_info()
    if not info.is_x86 or level == info.best_level:
        return {}
    aten = {"generic": "default", "avx2": "avx2"}.get(level, "avx512")
    onednn = {
        "generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE",
        "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX",
    }[level]  # fmt: skip
    env = {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn, "DNNL_MAX_CPU_ISA": onednn}
    if level in ("generic", "avx2"):
        env["MKL_ENABLE_INSTRUCTIONS"] = "AVX2" if level == "avx2" else "SSE4_2"
    return env
