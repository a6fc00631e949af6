"""Every linear kernel against the ceilings of the CPU at hand.

    python -m asyncpp.bench.peak [--rows 1,64,256] [--threads 1] [--repeats 5] [--json FILE]

First one core's ceilings (`asyncpp.kernels.peak`): the multiply-accumulate
rate of each instruction family the CPU has (float32 FMA on 256 and 512 bits,
vdpbf16ps, VNNI's vpdpbusd; AMX tiles are not measured) and one thread's read
and memcpy bandwidth. Then every path of `python -m asyncpp.bench.linears`
over the model's linears, each as a fraction of the best exact family's rate
(float32 FMA or vdpbf16ps: VNNI's 8-bit integers would round the bfloat16
activations), of any family's and of the float32 FMA's, and at one row, where the weights' bytes bound it, as a
fraction of memcpy and of the read bandwidth. With `--threads N` the ceilings
are N times one core's.
"""

from __future__ import annotations

import argparse
import json

import torch

from asyncpp.bench.linears import _linears, _stack, bench_level, memcpy_gbps
from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.peak import instruction_rates, read_gbps

_FMA = ("fma512 f32", "fma256 f32")  # the float32 FMA, widest first
# The families an exact linear can use: float32 FMA and vdpbf16ps take bfloat16 activations and the file's
# weights with exact products; VNNI multiplies 8-bit integers, so it would round the activations first.
_EXACT = (*_FMA, "vdpbf16ps")
_SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16", "amx_tile", "amx_bf16")


def kernel_fractions(
    result: dict, rates: dict[str, float | None], memcpy: float | None, read: float | None, threads: int = 1
) -> dict[str, float | None]:
    """A `bench_level` result's GMAC/s over the best family's rate, the best exact family's (`_EXACT`) and
    the widest float32 FMA's (times `threads`), and its weights' GB/s over memcpy's and the read
    bandwidth (None where not measured)."""
    best = max((r for r in rates.values() if r), default=None)
    best_exact = max((r for name, r in rates.items() if r and name in _EXACT), default=None)
    fma = next((rates[name] for name in _FMA if rates.get(name)), None)

    def over(value: float, ceiling: float | None, scale: int) -> float | None:
        return value / (ceiling * scale) if ceiling else None

    return {
        "of_best": over(result["gmacs"], best, threads),
        "of_exact": over(result["gmacs"], best_exact, threads),
        "of_fma": over(result["gmacs"], fma, threads),
        "of_memcpy": over(result["weights_gbps"], memcpy, 1),
        "of_read": over(result["weights_gbps"], read, 1),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.peak", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64,256", help="rows per linear, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the ceilings and results here")
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    info = cpu_info()
    flags = " ".join(f for f in _SHOWN_FLAGS if f in info.flags)
    print(f"CPU {info.model_name} ({flags}); per core:")
    rates = instruction_rates(info)
    for name, rate in rates.items():
        print(f"  {name:<24} {'not on this CPU' if rate is None else f'{rate:6.1f} GMAC/s'}")
    print(f"  {'AMX tiles':<24} {'not measured (no kernel)' if 'amx_tile' in info.flags else 'not on this CPU'}")
    read, copy = read_gbps(), memcpy_gbps()
    print(f"  read {read or 0:.1f} GB/s, memcpy {copy:.1f} GB/s (one thread)")
    linears = [_stack(parts) for parts in _linears()]
    results = []
    print(f"the model's linears, {ns.threads} thread(s): GMAC/s, % of the best exact instruction's rate (float32 FMA or"
          " vdpbf16ps; % of any instruction's, VNNI included; % of float32 FMA's);"
          " one row: weights' GB/s, % of memcpy (% of read)")  # fmt: skip
    for r in bench_level(info.best_level, linears, [int(x) for x in ns.rows.split(",")], ns.repeats):
        fr = kernel_fractions(r, rates, copy, read, ns.threads)
        results.append({**r, **fr})
        line = (
            f"  {r['kernel']:<18} rows {r['rows']:>4}: {r['gmacs']:6.1f} GMAC/s {_pct(fr['of_exact']):>5}"
            f" ({_pct(fr['of_best'])}; {_pct(fr['of_fma'])})"
        )
        if r["rows"] == 1:
            line += f"; {r['weights_gbps']:5.1f} GB/s {_pct(fr['of_memcpy']):>5} ({_pct(fr['of_read'])})"
        print(line)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"cpu": info.model_name, "flags": flags, "threads": ns.threads, "rates_gmacs": rates,
                       "read_gbps": read, "memcpy_gbps": copy, "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
