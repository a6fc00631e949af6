"""`python -m asyncpp.bench.attention`: the CPU decode-attention kernel on a cold, stage-sized step.

A step of a pipeline stage runs `--layers` layers, each with its own paged K
and V cache; the requests' blocks are scattered over a pool twice as large
as they need (shuffled, as the block allocator leaves them after a while) and
the same block table serves every layer, as in the engine. Between two
layers `--evict-mb` of other memory is read (untimed), standing for the
layer's linear weights, so a layer's cache rows come from memory, as they do
in a serving step. The caches sit on huge pages where the engine's do.

The time of a step is the sum of its layers' kernel calls. With
`--baseline FILE.c` another build of the kernel (for instance
`git show HEAD:asyncpp/kernels/decode_attention.c > /tmp/old.c`) is timed in
the same process, its steps interleaved with this one's, and its outputs are
compared bit for bit with this one's on the step and on a few random cases of
other shapes, in float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch

from asyncpp.kernels import build, huge_pages
from asyncpp.kernels.decode_attention import DecodeAttention, decode_attention_kernel, wrap_library
from asyncpp.kernels.isa import native_level

BLOCK_SIZE = 16
# Head shapes the bit-for-bit comparison runs besides the step's: (num_heads, num_kv_heads, head_dim).
CHECK_SHAPES = [(9, 3, 64), (4, 2, 16), (8, 2, 64), (4, 4, 32), (6, 1, 128), (3, 3, 48), (16, 1, 64)]


def load_source(path: Path, isa: str, workdir: Path) -> ctypes.CDLL:
    """A build of the kernel source at `path` with the package's headers and `build`'s flags."""
    target = workdir / f"{path.stem}-{isa}.so"
    build.compile_source(path.read_bytes(), isa, target)
    return ctypes.CDLL(str(target))


def _as_the_engine_places_it(cache: torch.Tensor) -> torch.Tensor:
    """`cache`'s values in memory placed as the engine places its KV caches (`huge_pages.zeros`, see
    `asyncpp.worker.kv_cache`): on 4 KB pages a cold step's page walks made it 1.17x as long."""
    return huge_pages.zeros(tuple(cache.shape), cache.dtype).copy_(cache)


class Step:
    """One stage step: `layers` caches and queries, `context_lens` requests over one shuffled block table,
    each request `rows_per_request` rows at its last positions (a token and its speculative drafts, or a
    prefill chunk's tail: the same blocks, contexts ending at n - R + 1 .. n)."""

    def __init__(self, layers, context_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0, rows_per_request=1):
        g = torch.Generator().manual_seed(seed)
        blocks_per_req = [-(-n // BLOCK_SIZE) for n in context_lens]
        max_blocks = max(blocks_per_req)
        pool = torch.randperm(2 * sum(blocks_per_req), generator=g)
        self.block_table = torch.zeros(len(context_lens), max_blocks, dtype=torch.int64)
        used = 0
        for i, n in enumerate(blocks_per_req):
            self.block_table[i, :n] = pool[used : used + n]
            used += n
        slots = pool.numel() * BLOCK_SIZE
        self.caches = [
            tuple(_as_the_engine_places_it(torch.randn(slots, num_kv_heads, head_dim, generator=g).to(dtype))
                  for _ in range(2))
            for _ in range(layers)
        ]
        rows_of = [max(1, n - r) for n in context_lens for r in reversed(range(rows_per_request))]
        self.block_table = self.block_table.repeat_interleave(rows_per_request, dim=0)
        self.context_lens = torch.tensor(rows_of, dtype=torch.int64)
        self.queries = [torch.randn(len(rows_of), num_heads, head_dim, generator=g).to(dtype) for _ in range(layers)]
        self.rows = torch.arange(len(rows_of))
        self.scale = head_dim**-0.5
        self.kv_bytes = int(self.context_lens.sum()) * num_kv_heads * head_dim * 2 * self.queries[0].element_size()

    def run(self, fn: DecodeAttention, layer: int) -> torch.Tensor:
        q = self.queries[layer]
        k_cache, v_cache = self.caches[layer]
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
        max_ctx = int(self.context_lens.max())
        fn(q, k_cache, v_cache, self.block_table, self.rows, self.context_lens, max_ctx, BLOCK_SIZE, out, self.scale)
        return out


def time_steps(step: Step, kernels: dict[str, DecodeAttention], repeats: int, evict_mb: int) -> dict[str, list[float]]:
    """Seconds per step of each kernel, the kernels' steps interleaved (order alternating)."""
    evict = torch.ones(evict_mb * (1 << 18))  # float32
    names = list(kernels)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats + 1):  # the first round warms up
        for name in names if r % 2 == 0 else names[::-1]:
            total = 0.0
            for layer in range(len(step.caches)):
                evict.sum()
                t0 = time.perf_counter()
                step.run(kernels[name], layer)
                total += time.perf_counter() - t0
            if r > 0:
                times[name].append(total)
    return times


def identical_outputs(baseline_lib: ctypes.CDLL, isa: str, seed: int = 1) -> list[str]:
    """Cases (shape, dtype) where the baseline's outputs differ from this kernel's in any bit."""
    differing = []
    for num_heads, num_kv_heads, head_dim in CHECK_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            current = decode_attention_kernel("cpu", dtype, num_heads, num_kv_heads, head_dim, isa)
            baseline = wrap_library(baseline_lib, dtype)
            for rows_per_request in (1, 5):
                step = Step(1, [1, 15, 16, 17, 33, 64, 100, 130, 203], num_heads, num_kv_heads, head_dim, dtype, seed,
                            rows_per_request)
                view = torch.int16 if dtype == torch.bfloat16 else torch.int32
                if not torch.equal(step.run(current, 0).view(view), step.run(baseline, 0).view(view)):
                    differing.append(f"{num_heads}/{num_kv_heads}x{head_dim} {dtype} {rows_per_request} rows/request")
    return differing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, nargs="*", default=[], help="other decode_attention.c to time and compare")
    parser.add_argument("--isa", default=native_level())
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rows-per-request", type=int, default=1,
                        help="rows of each request at its last positions (speculative decoding: 1 + k)")
    parser.add_argument("--min-context", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=130)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per kernel and thread count")
    parser.add_argument("--evict-mb", type=int, default=8, help="memory read between layers (untimed)")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    context_lens = torch.randint(args.min_context, args.max_context + 1, (args.requests,), generator=g).tolist()
    step = Step(args.layers, context_lens, *args.heads, dtype, rows_per_request=args.rows_per_request)
    kernels = {"current": decode_attention_kernel("cpu", dtype, *args.heads, isa=args.isa)}
    if kernels["current"] is None:
        raise SystemExit("the decode-attention kernel is unavailable here")
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.baseline:
            lib = load_source(path, args.isa, Path(tmp))
            kernels = {path.stem: wrap_library(lib, dtype), **kernels}
            differing = identical_outputs(lib, args.isa)
            same_step = all(torch.equal(step.run(kernels[path.stem], i), step.run(kernels["current"], i))
                            for i in range(args.layers))
            print(f"{path}: bit-identical to this kernel on the step: {same_step}; on random cases: "
                  + ("all" if not differing else f"not {differing}"))
        print(f"{args.isa} {args.dtype}: {args.layers} layers x {args.requests} requests x {args.rows_per_request} rows, contexts "
              f"{args.min_context}-{args.max_context}, {step.kv_bytes * args.layers / 1e6:.1f} MB of K/V per step")
        previous = torch.get_num_threads()
        try:
            for threads in args.threads:
                torch.set_num_threads(threads)
                times = time_steps(step, kernels, args.repeats, args.evict_mb)
                for name, samples in times.items():
                    med = statistics.median(samples)
                    print(f"  {threads} thread(s) {name:>12}: {med * 1e3:7.3f} ms/step (median of {len(samples)}), "
                          f"{step.kv_bytes * args.layers / med / 1e9:5.1f} GB/s of K/V")
        finally:
            torch.set_num_threads(previous)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
