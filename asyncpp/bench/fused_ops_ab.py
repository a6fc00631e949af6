"""Versions of the fused layer ops (add + RMSNorm, SiLU * up, RoPE) against each other, in one process.

    python -m asyncpp.bench.fused_ops_ab [--rows 8,32,128] [--level avx512_bf16] [--dtype bfloat16] TREE [TREE ...]

Each TREE is a checkout of asyncpp; its `asyncpp/kernels/fused_ops.c` (with the headers beside it) is
compiled for `--level` (default: the CPU's best) and loaded next to the others. On SmolLM2's shapes
(hidden 576, intermediate 1536, 9 + 3 heads of 64), each repetition times every op on every version in
turn, so a slow spell of a shared machine falls on all of them alike. Printed per op and row count: each
version's median time and its ratio to the first's, and whether every version wrote the first's bits.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asyncpp.kernels.build import compile_checkout
from asyncpp.kernels.fused_ops import CFusedOps
from asyncpp.kernels.isa import native_level

HIDDEN, INTER, HEADS, HEAD_DIM = 576, 1536, 9 + 3, 64  # SmolLM2-135M: q and k heads get RoPE
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def load_version(tree: Path, out_dir: Path, index: int, level: str, dtype: torch.dtype) -> CFusedOps:
    """The ops of checkout `tree` (its source and headers), built into `out_dir` as the package builds its own."""
    so = out_dir / f"fused_ops_{index}.so"
    compile_checkout(tree, "fused_ops", level, so)
    return CFusedOps(ctypes.CDLL(str(so)), dtype)


def _cases(rows: int, dtype: torch.dtype) -> dict[str, Callable[[CFusedOps], torch.Tensor]]:
    """Per op, a call on fixed random inputs of `rows` rows returning what it wrote."""
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, HIDDEN, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.3 * torch.randn(HIDDEN, generator=g)).to(dtype)
    gate_up = (2 * torch.randn(rows, 2 * INTER, generator=g)).to(dtype)
    qk = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(dtype)
    positions = torch.randint(0, 2048, (rows,), generator=g)
    angles = torch.arange(2048)[:, None] * torch.rand(HEAD_DIM // 2, generator=g).repeat(2)[None, :]
    cos, sin = angles.cos(), angles.sin()
    return {
        "add_rms_norm": lambda ops: torch.cat(ops.add_rms_norm(x, residual, weight, 1e-5), dim=1),
        "silu_mul": lambda ops: ops.silu_mul(gate_up),
        "rope": lambda ops: ops.rope_(qk.clone(), positions, cos, sin),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.fused_ops_ab", description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--level", default=None, help="ISA level to build for (default: the CPU's best)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    level, dtype = ns.level or native_level(), DTYPES[ns.dtype]
    print(f"fused ops at level {level}, {ns.dtype}, one thread; median of {ns.repeats} timings of a batch of calls")
    with tempfile.TemporaryDirectory() as tmp:
        built: dict[Path, CFusedOps] = {}  # a tree named twice (a noise check) is built once
        for i, tree in enumerate(ns.trees):
            if tree.resolve() not in built:
                built[tree.resolve()] = load_version(tree, Path(tmp), i, level, dtype)
        versions = [built[t.resolve()] for t in ns.trees]
        for rows in (int(r) for r in ns.rows.split(",")):
            calls = max(1, 4096 // rows)  # a batch long enough for the clock
            for op, run in _cases(rows, dtype).items():
                outputs = [_bits(run(ops)) for ops in versions]  # also the warm-up
                same = all(torch.equal(outputs[0], o) for o in outputs[1:])
                times: list[list[float]] = [[] for _ in versions]
                for _ in range(ns.repeats):
                    for i, ops in enumerate(versions):
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            run(ops)
                        times[i].append((time.perf_counter() - t0) / calls)
                base = statistics.median(times[0])
                cells = "  ".join(f"{statistics.median(ts) * 1e6:8.2f} us {statistics.median(ts) / base:.3f}x" for ts in times)
                print(f"rows {rows:4} {op:13} {cells}   {'same bits' if same else 'BITS DIFFER'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
