"""How many rows the bfloat16 linears multiply with float32 FMA rather than vdpbf16ps, chosen by measurement.

`linear_bf16`'s paths give the same bits (`bf16_fma.h`): vdpbf16ps streaming or
expanded, or float32 FMA over weights widened in the kernel. Which is faster
depends on the CPU: a Zen 4 runs vdpbf16ps at twice its float32 FMA rate, a Xeon
(family 6 model 207) the FMA at twice vdpbf16ps's (`python -m asyncpp.bench.peak`).
Few rows are bound by reading the weights and stream them through vdpbf16ps; from
some row count on, the FMA path may win. `choose_fma_min_rows` finds that count:

1. the FMA path must give vdpbf16ps's bits on this CPU (`fma_matches_dpbf16`:
   random rows and weights, denormals and cancellations included); where it
   does not, rows never take it, so a row's bits never depend on its batch;
2. both paths are timed on a small L2-resident linear per weight kind (GGUF
   blocks, float weights) at `PROBE_ROWS`, interleaved, best of `repeats`
   (about 0.1 s in all); the count is the smallest probed one from which the
   FMA path is at least `MARGIN` faster at every larger probe;
3. the result is cached per CPU (model name, flags) and kernel build in
   `$ASYNCPP_KERNEL_CACHE/linear_choice.json`, so every later start-up on the
   CPU takes the same paths without probing or measuring again.

`model.fma_min_rows` forces a count (0: never FMA). The choice is made once per
deployment (the launcher's compute plan) and handed to every stage, so it never
changes within a deployment; its reason goes into the ready line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from asyncpp.kernels.isa import CpuInfo, cpu_info

if TYPE_CHECKING:  # torch and the kernels load where a choice is measured, not where the plan is read
    import torch

    from asyncpp.kernels.linear_bf16 import Bf16Linear

PROBE_ROWS = (2, 4, 8, 16, 32, 64)
MARGIN = 1.05  # the FMA path must be this much faster where it is chosen
KINDS = ("blocks", "float")  # GGUF blocks (Q4_1 probed), float weights (bfloat16 pairs)
_PROBE_SHAPE = (512, 576)  # out, in: SmolLM2's hidden size; 0.18 MB of Q4_1, 0.6 MB of bfloat16

# measure(kind, rows) -> (vdpbf16ps GMAC/s, FMA GMAC/s): the hook tests replace.
Measure = Callable[[str, int], tuple[float, float]]


@dataclass(frozen=True)
class LinearChoice:
    """Rows from which each weight kind takes float32 FMA (None: never), and why."""

    block_rows: int | None
    float_rows: int | None
    source: str  # "measured" | "cached" | "forced" | "inexact" | "n/a"
    reason: str
    gmacs: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict, compare=False)

    def summary(self) -> str:
        return f"linears {self.reason}"

    def describe(self) -> dict:
        return {"fma_min_rows_blocks": self.block_rows, "fma_min_rows_float": self.float_rows,
                "linear_choice": self.source, "linear_reason": self.reason}  # fmt: skip


NOT_APPLICABLE = LinearChoice(None, None, "n/a", "no bfloat16 kernel choice (not bfloat16 on an AVX512-BF16 CPU)")


def min_rows_from(gmacs: dict[int, tuple[float, float]], margin: float = MARGIN) -> int | None:
    """The smallest probed row count from which FMA (second) beats vdpbf16ps (first) by `margin` at every
    larger probe; None if it does not at the largest."""
    chosen = None
    for rows in sorted(gmacs, reverse=True):
        dp, fma = gmacs[rows]
        if fma < dp * margin:
            break
        chosen = rows
    return chosen


def choose_fma_min_rows(
    kernel: Bf16Linear,
    forced: int = -1,
    info: CpuInfo | None = None,
    measure: Measure | None = None,
    exact: Callable[[Bf16Linear], bool] | None = None,
    cache: Path | None = None,
) -> LinearChoice:
    """The choice for `kernel` on this CPU: `forced` >= 0 is model.fma_min_rows (0: never); else the cached
    or measured one. `measure` and `exact` are hooks (default: time and check the kernel itself)."""
    if forced == 0:
        return LinearChoice(None, None, "forced", "vdpbf16ps at every row count (model.fma_min_rows = 0)")
    if forced > 0:
        return LinearChoice(forced, forced, "forced", f"float32 FMA from {forced} rows (model.fma_min_rows)")
    from asyncpp.kernels.build import kernel_cache_dir

    info = info or cpu_info()
    cache = cache or kernel_cache_dir() / "linear_choice.json"
    key = _cache_key(info, kernel)
    if measure is None and (hit := _read_cache(cache, key)) is not None:
        # Written only after the probe passed for this CPU model, flags and build: it would pass again.
        measured = f"{hit[2]}, cached" if hit[2] else "measured before on this CPU"
        return LinearChoice(hit[0], hit[1], "cached", f"{_rows_text(hit[0], hit[1])} ({measured})")
    if not (exact or fma_matches_dpbf16)(kernel):
        return LinearChoice(None, None, "inexact", "vdpbf16ps at every row count: float32 FMA gives other bits here")
    measure = measure or (lambda kind, rows: measure_paths(kernel, kind, rows))
    gmacs = {kind: {rows: measure(kind, rows) for rows in PROBE_ROWS} for kind in KINDS}
    block_rows, float_rows = (min_rows_from(gmacs[kind]) for kind in KINDS)
    at = max(PROBE_ROWS)
    dp, fma = gmacs["blocks"][at]
    measured = f"measured at {at} rows: vdpbf16ps {dp:.0f}, FMA {fma:.0f} GMAC/s"
    _write_cache(cache, key, (block_rows, float_rows), measured)
    return LinearChoice(block_rows, float_rows, "measured", f"{_rows_text(block_rows, float_rows)} ({measured})", gmacs)


def _rows_text(block_rows: int | None, float_rows: int | None) -> str:
    def one(rows: int | None) -> str:
        return "vdpbf16ps at every row count" if rows is None else f"float32 FMA from {rows} rows"

    if block_rows == float_rows:
        return one(block_rows)
    return f"GGUF blocks {one(block_rows)}, float weights {one(float_rows)}"


def measure_paths(kernel: Bf16Linear, kind: str, rows: int, repeats: int = 5) -> tuple[float, float]:
    """(vdpbf16ps, FMA) GMAC/s of one probe linear of `kind` at `rows`, best of `repeats`, interleaved."""
    import torch

    gen = torch.Generator().manual_seed(rows)
    n, k = _PROBE_SHAPE
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    if kind == "blocks":
        packed = kernel.pack_blocks("q4_1", _random_q4_1(n, k, gen), n, k)
        run = lambda: kernel.linear_blocks("q4_1", x, packed, n)  # noqa: E731
    else:
        packed = kernel.pack(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        run = lambda: kernel.linear(x, packed, n)  # noqa: E731
    before, threads = kernel.fma_min_rows(), torch.get_num_threads()
    best = [float("inf"), float("inf")]
    torch.set_num_threads(1)  # a core's rates: the kernels take torch's thread count
    try:
        for _ in range(repeats):
            for path, (float_rows, block_rows) in enumerate(((None, None), (1, 1))):
                kernel.set_fma_min_rows(float_rows, block_rows)
                run()  # warm: the weights in cache, the path's buffers allocated once
                t0 = time.perf_counter()
                run()
                best[path] = min(best[path], time.perf_counter() - t0)
    finally:
        kernel.set_fma_min_rows(before[0], before[1])
        torch.set_num_threads(threads)
    macs = rows * n * k
    return macs / best[0] / 1e9, macs / best[1] / 1e9


def fma_matches_dpbf16(kernel: Bf16Linear) -> bool:
    """Whether the FMA path gives the vdpbf16ps paths' bits on this CPU, for both weight kinds, at rows that
    stream and rows that expand, on values that round, cancel and flush (denormals) in every way."""
    import torch

    gen = torch.Generator().manual_seed(0)
    n, k = 80, 192
    q4_1 = _random_q4_1(n, k, gen)
    before = kernel.fma_min_rows()
    outs = []
    try:
        for rows in ((None, None), (1, 1)):
            kernel.set_fma_min_rows(*rows)
            for x_exp, w_exp in zip(PROBE_EXPONENTS["x"], PROBE_EXPONENTS["w"]):
                x = _wide_bf16(40, k, torch.Generator().manual_seed(x_exp[0]), x_exp)
                weights = _wide_bf16(n, k, torch.Generator().manual_seed(w_exp[0]), w_exp)
                for out_dtype in (torch.float32, torch.bfloat16):
                    for m in (3, 40):
                        outs.append(kernel.linear_blocks("q4_1", x[:m], kernel.pack_blocks("q4_1", q4_1, n, k), n,
                                                         out_dtype=out_dtype))  # fmt: skip
                        outs.append(kernel.linear(x[:m], kernel.pack(weights), n, out_dtype=out_dtype))
    finally:
        kernel.set_fma_min_rows(before[0], before[1])
    half = len(outs) // 2
    return all(_same_bits(a, b) for a, b in zip(outs[:half], outs[half:]))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return torch.equal(a.view(view), b.view(view))


def _wide_bf16(rows: int, cols: int, gen: torch.Generator, exponents: tuple[int, int] = (0, 253)) -> torch.Tensor:
    """bfloat16 values with biased exponents uniform in `exponents` (0: denormals), random signs and
    mantissas, one in 17 an exact zero (+0 or -0)."""
    import torch

    bits = torch.randint(0, 1 << 16, (rows, cols), generator=gen, dtype=torch.int32)
    exponent = torch.randint(exponents[0], exponents[1] + 1, (rows, cols), generator=gen, dtype=torch.int32)
    value = (bits & 0x807F) | (exponent << 7)
    value = torch.where(bits % 17 == 0, bits & 0x8000, value)
    return value.to(torch.int16).view(torch.bfloat16)


# Biased exponents of inputs and float weights whose products and sums land in every range: around 1,
# and tiny ones whose products (2^-154 .. 2^-102) and partial sums are denormal or flush.
PROBE_EXPONENTS = {"x": ((100, 150), (0, 12)), "w": ((100, 150), (100, 140))}


def _random_q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """GGUF Q4_1 rows [n, k / 32 * 20]: random nibbles, scales and offsets."""
    import torch

    nb = k // 32
    blocks = torch.randint(0, 256, (n, nb, 20), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, nb, generator=gen) * 0.02 + 1e-3).to(torch.float16)
    offset = (torch.randn(n, nb, generator=gen) * 0.05).to(torch.float16)
    blocks[:, :, 0:2] = scale.view(torch.uint8).view(n, nb, 2)
    blocks[:, :, 2:4] = offset.view(torch.uint8).view(n, nb, 2)
    return blocks.reshape(n, nb * 20)


def _cache_key(info: CpuInfo, kernel: Bf16Linear) -> str:
    library = getattr(kernel.library, "_name", "")
    text = "\n".join((info.model_name, " ".join(sorted(info.flags)), os.path.basename(library)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_cache(path: Path, key: str) -> tuple[int | None, int | None, str] | None:
    """(block rows, float rows, what was measured) of this CPU's entry, or None."""
    try:
        entry = json.loads(path.read_text()).get(key)
        return None if entry is None else (entry["block_rows"], entry["float_rows"], str(entry.get("measured", "")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path: Path, key: str, rows: tuple[int | None, int | None], measured: str) -> None:
    """Add this CPU's entry (a private temporary file renamed into place: writers race safely)."""
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {"block_rows": rows[0], "float_rows": rows[1], "measured": measured}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: the next start-up measures again
