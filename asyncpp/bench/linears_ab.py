"""Versions of the bfloat16 linear kernel against each other, in one process, pass by pass.

    python -m asyncpp.bench.linears_ab --rows 24,64,256 [--fma] [--formats q8_0] TREE [TREE ...]

Each TREE is a checkout of asyncpp; its `asyncpp/kernels/linear_bf16.c` (with the headers beside it) is
compiled for level `avx512_bf16` and loaded next to the others. Every repetition runs one pass over all
the model's linears (`bench.linears`) with each version in turn, so a slow spell of a shared machine
falls on all of them alike; printed: GMAC/s best and median per version and row count, and each
version's median time as a ratio to the first's. `--fma` forces the float32 FMA path (the same bits);
`--formats` keeps the linears of those GGUF formats only (SmolLM2: `q8_0` is the lm_head alone).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch

from asyncpp.bench.linears import _linears, _stack
from asyncpp.kernels.build import compile_checkout
from asyncpp.kernels.linear_bf16 import Bf16Linear, Bf16NativeKernel


def load_version(tree: Path, out_dir: Path, index: int, fma: bool) -> Bf16NativeKernel:
    """The kernel of checkout `tree` (its source and headers), built into `out_dir` as the package builds its own."""
    so = out_dir / f"linear_bf16_{index}.so"
    compile_checkout(tree, "linear_bf16", "avx512_bf16", so)
    kernel = Bf16Linear(ctypes.CDLL(str(so)))
    kernel.set_fma_min_rows(*((1, 1) if fma else (None, None)))
    return Bf16NativeKernel(kernel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.linears_ab", description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("--rows", default="24,64,256")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--fma", action="store_true", help="the float32 FMA path instead of vdpbf16ps")
    ap.add_argument("--formats", default="", help="only the linears of these formats, comma-separated (q8_0, q4_1)")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    linears = [_stack(parts) for parts in _linears()]
    if ns.formats:
        formats = ns.formats.split(",")
        linears = [w for w in linears if w.format in formats]
        if not linears:
            ap.error(f"no linear of the model is in {formats}")
    macs = sum(w.shape[0] * w.shape[1] for w in linears)
    with tempfile.TemporaryDirectory() as tmp:
        built: dict[Path, Bf16NativeKernel] = {}  # a tree named twice (a noise check) is built once
        for i, tree in enumerate(ns.trees):
            if tree.resolve() not in built:
                built[tree.resolve()] = load_version(tree, Path(tmp), i, ns.fma)
        kernels = [built[t.resolve()] for t in ns.trees]
        packed = [[(w.format, k.pack(w.format, w.rows, *w.shape), w.shape) for w in linears] for k in kernels]
        for m in (int(r) for r in ns.rows.split(",")):
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {w.shape[1] for w in linears}}
            times: list[list[float]] = [[] for _ in kernels]
            for rep in range(ns.repeats + 1):  # the first pass of each warms up and is not counted
                for i, kernel in enumerate(kernels):
                    t0 = time.perf_counter()
                    for fmt, p, (n, k) in packed[i]:
                        kernel.linear(fmt, xs[k], p, n)
                    if rep:
                        times[i].append(time.perf_counter() - t0)
            base = statistics.median(times[0])
            for tree, ts in zip(ns.trees, times):
                print(
                    f"rows {m:4} {str(tree):24} best {macs * m / min(ts) / 1e9:6.1f} median "
                    f"{macs * m / statistics.median(ts) / 1e9:6.1f} GMAC/s, median time {statistics.median(ts) / base:.3f}x the first's"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
