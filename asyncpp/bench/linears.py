"""The linears of the real SmolLM2 on their own: how fast each kernel reads and multiplies them.

    python -m asyncpp.bench.linears [--isa auto,avx2] [--rows 1,16,64,256] [--threads 1]

Every linear of the model (30 layers' qkv, o, gate_up and down, and the tied
lm_head: 97 MB of GGUF blocks, more than the L3 cache) runs once per pass,
as a decode step does. For each ISA level: native float32 (`qlinear`),
native bfloat16 (`linear_bf16` over the blocks, AVX512-BF16 only) by
vdpbf16ps and by float32 FMA (the same bits), the float path's bfloat16
weights both ways, and oneDNN's bfloat16 `F.linear` (vLLM's path), at each
row count. Reported: milliseconds per
pass, GB/s of weights read (one row: the memory-bound case), GMAC/s, and a
one-thread `memcpy` of a 256 MB buffer (bytes copied per second) as the
reference, measured in the same run: "the decode linear at one row reads
weights at X% of a one-core memcpy".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import torch

from asyncpp.bench.memcpy import time_memcpy_us
from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.linear_bf16 import bf16_native_kernel, linear_bf16_kernel
from asyncpp.kernels.qlinear import qlinear_kernel
from asyncpp.weights import load_weights, read_arch
from asyncpp.weights.base import LM_HEAD_NAME, StoredTensor

_GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


def _linears() -> list[list[StoredTensor]]:
    """Each linear of the model as its GGUF parts (q/k/v and gate/up stacked like the model does)."""
    arch = read_arch("gguf", None)
    tensors = load_weights("gguf", None, start_layer=0, end_layer=arch.num_layers, need_embed=False, need_head=True, native=True)
    out = []
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        for group in _GROUPS:
            names = [f"{prefix}{'mlp' if p in ('gate', 'up', 'down') else 'self_attn'}.{p}_proj.weight" for p in group]
            out.append([tensors[n] for n in names])
    out.append([tensors[LM_HEAD_NAME]])
    return out


def _stack(parts: list[StoredTensor]) -> StoredTensor:
    if len(parts) == 1:
        return parts[0]
    rows = torch.cat([p.rows for p in parts])
    return StoredTensor(parts[0].format, rows, (rows.shape[0], parts[0].shape[1]), "+".join(p.name for p in parts))


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes copied per second by one thread, median of `repeats` copies of an `nbytes` buffer."""
    return nbytes / (time_memcpy_us(nbytes, num_threads=1, repeats=repeats)["p50_us"] * 1e-6) / 1e9


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kernels(isa: str) -> list[tuple[str, object, torch.dtype, Callable, Callable | None]]:
    """(name, kernel, activation dtype, pack(stored) -> (fmt, packed), fma_min_rows setter or None) per path:
    native float32, native bfloat16 by vdpbf16ps and by float32 FMA (the same bits), the float path's
    bfloat16 weights both ways, and oneDNN's bfloat16 matmul (`F.linear`, what vLLM runs)."""
    out = []
    q = qlinear_kernel(isa)
    if q is not None:
        out.append(("native float32", q, torch.float32, lambda w: (w.format, q.pack(w.format, w.rows, *w.shape)), None))
    b = bf16_native_kernel(isa)
    if b is not None:
        pack = lambda w: (w.format, b.pack(w.format, w.rows, *w.shape))  # noqa: E731
        out.append(("native bf16 dpbf16", b, torch.bfloat16, pack, lambda: b.kernel.set_fma_min_rows(None, None)))
        out.append(("native bf16 fma", b, torch.bfloat16, pack, lambda: b.kernel.set_fma_min_rows(1, 1)))
    f = linear_bf16_kernel("cpu", torch.bfloat16, isa)
    if f is not None and q is not None:
        pack = lambda w: ("bf16", f.pack(_float_weight(q, w).to(torch.bfloat16)))  # noqa: E731
        out.append(("float bf16 dpbf16", f, torch.bfloat16, pack, lambda: f.set_fma_min_rows(None, None)))
        out.append(("float bf16 fma", f, torch.bfloat16, pack, lambda: f.set_fma_min_rows(1, 1)))
    if q is not None:
        onednn = SimpleNamespace(linear=lambda fmt, x, w, n: torch.nn.functional.linear(x, w))
        out.append(("onednn bf16", onednn, torch.bfloat16, lambda w: ("bf16", _float_weight(q, w).to(torch.bfloat16)), None))
    return out


def _float_weight(q, w: StoredTensor) -> torch.Tensor:
    """The GGUF weight dequantized to float32 (the float path's weights before their rounding)."""
    return q.dequant_rows(w.format, q.pack(w.format, w.rows, *w.shape), w.shape[1], torch.arange(w.shape[0]))


def bench_level(isa: str, linears: list[StoredTensor], rows: list[int], repeats: int) -> list[dict]:
    """Every path of `_kernels` over all the model's linears, at each row count: a dict per (path, rows)."""
    results = []
    for name, kernel, dtype, pack, choose_path in _kernels(isa):
        packed = [(pack(w), w.shape) for w in linears]
        nbytes = sum(p.numel() * p.element_size() for (_, p), _ in packed)
        macs = sum(n * k for _, (n, k) in packed)
        for m in rows:
            xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, (_, k) in packed}}
            if name.startswith("float bf16"):
                run = lambda: [kernel.linear(xs[k], p, n) for (_, p), (n, k) in packed]  # noqa: E731
            else:
                run = lambda: [kernel.linear(fmt, xs[k], p, n) for (fmt, p), (n, k) in packed]  # noqa: E731
            if choose_path is not None:
                choose_path()
            seconds = _time(run, repeats)
            results.append({
                "isa": isa, "kernel": name, "rows": m, "ms": seconds * 1e3, "weight_mb": nbytes / 1e6,
                "weights_gbps": nbytes / seconds / 1e9, "gmacs": macs * m / seconds / 1e9,
            })  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.linears", description=__doc__.split("\n")[0])
    ap.add_argument("--isa", default="auto,avx2", help="ISA levels to run (auto = the CPU's best), comma-separated")
    ap.add_argument("--rows", default="1,16,64,256", help="rows per linear (a decode step's batch)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    info = cpu_info()
    levels = [info.best_level if lv == "auto" else lv for lv in ns.isa.split(",")]
    rows = [int(r) for r in ns.rows.split(",")]
    linears = [_stack(parts) for parts in _linears()]
    copy = memcpy_gbps()
    print(f"CPU {info.model_name} (best level {info.best_level}), {ns.threads} thread(s); one-thread memcpy {copy:.1f} GB/s")
    results = []
    for isa in levels:
        for r in bench_level(isa, linears, rows, ns.repeats):
            results.append(r)
            share = f", {100 * r['weights_gbps'] / copy:.0f}% of memcpy" if r["rows"] == 1 else ""
            print(
                f"{r['isa']:>12} {r['kernel']:<18} rows {r['rows']:>4}: {r['ms']:8.2f} ms per pass "
                f"({r['weight_mb']:.0f} MB), {r['weights_gbps']:5.1f} GB/s of weights{share}, {r['gmacs']:6.1f} GMAC/s"
            )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"cpu": info.model_name, "threads": ns.threads, "memcpy_gbps": copy, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
