"""One core's ceilings: each multiply-accumulate instruction family's rate and the read bandwidth (`peak.c`).

`instruction_rates()` gives GMAC/s per family for one core (None: not on this
CPU, or the library was built without it), `read_gbps()` the bytes one thread
reads per second from a buffer far larger than the caches. `python -m
asyncpp.bench.peak` prints them beside every linear kernel's rate.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from asyncpp.kernels.build import load_kernel_library
from asyncpp.kernels.isa import CpuInfo, cpu_info, native_level


@dataclass(frozen=True)
class Family:
    """An instruction family: its C entry, MACs per instruction, and the /proc/cpuinfo flags it needs."""

    name: str
    entry: str
    macs: int
    flags: tuple[str, ...]


FAMILIES = (
    Family("fma256 f32", "peak_fma256", 8, ("avx2", "fma")),
    Family("fma512 f32", "peak_fma512", 16, ("avx512f",)),
    Family("vdpbf16ps", "peak_dpbf16", 32, ("avx512f", "avx512_bf16")),
    Family("vpdpbusd zmm (VNNI)", "peak_vnni512", 64, ("avx512f", "avx512_vnni")),
    Family("vpdpbusd ymm (AVX-VNNI)", "peak_vnni256", 32, ("avx2", "avx_vnni")),
)
ROUNDS_PER_CALL = 12  # instructions per round (ACCS in peak.c)


def _library() -> ctypes.CDLL | None:
    lib = load_kernel_library("peak", native_level())
    if lib is None:
        return None
    for family in FAMILIES:
        fn = getattr(lib, family.entry)
        fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.POINTER(ctypes.c_float)], ctypes.c_double
    lib.peak_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64)]
    lib.peak_read.restype = ctypes.c_double
    return lib


def instruction_rates(info: CpuInfo | None = None, seconds_each: float = 0.05, tries: int = 3) -> dict[str, float | None]:
    """GMAC/s of one core per family (best of `tries` runs of about `seconds_each`); None where the CPU
    (`info`, default this one) lacks the family's flags or the library was built without it."""
    info = info or cpu_info()
    lib = _library()
    sink = ctypes.c_float()
    rates: dict[str, float | None] = {}
    for family in FAMILIES:
        if lib is None or not info.is_x86 or not all(flag in info.flags for flag in family.flags):
            rates[family.name] = None
            continue
        fn = getattr(lib, family.entry)
        iters = 1000
        while (elapsed := fn(iters, ctypes.byref(sink))) >= 0 and elapsed < seconds_each / 4:
            iters *= 4  # until one run takes a quarter of the budget
        if elapsed < 0:
            rates[family.name] = None
            continue
        iters = max(1, int(iters * seconds_each / max(elapsed, 1e-9)))
        best = min(fn(iters, ctypes.byref(sink)) for _ in range(tries))
        rates[family.name] = iters * ROUNDS_PER_CALL * family.macs / best / 1e9
    return rates


def read_gbps(nbytes: int = 256 << 20, tries: int = 3) -> float | None:
    """Bytes one thread reads per second from an `nbytes` buffer (touched once first), best of `tries`."""
    lib = _library()
    if lib is None:
        return None
    buffer = (ctypes.c_uint8 * nbytes)()
    ctypes.memset(buffer, 1, nbytes)
    sink = ctypes.c_uint64()
    best = min(lib.peak_read(buffer, nbytes, ctypes.byref(sink)) for _ in range(tries))
    return nbytes / best / 1e9
