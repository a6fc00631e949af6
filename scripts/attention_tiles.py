"""Time the Triton paged decode-attention kernel per tile size, warp count and product (broadcast
sums or `tl.dot`), on a lent GPU.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, bfloat16, blocks of 16),
for the step shapes the serving benchmark makes: one row of 192 keys (concurrency 1), 64 and 256
rows of 96-224 keys (decode at c = 64, 256), 256 rows of 400-600 keys, and a 2048-token prompt
chunk (row i attends i + 1 keys). Each variant is checked against the tile-of-one-block variant
(and, for 64 rows, a float64 reference) before it is timed; times are medians of CUDA-graph
replays (`triton.testing.do_bench_cudagraph`), so launch overhead stays out. Prints one table;
`--json PATH` writes it.

    python scripts/attention_tiles.py [--json $OUT/attention_tiles.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from asyncpp.kernels.triton_attention import triton_attention_kernel  # noqa: E402
from tests.kernels.test_decode_attention import _case, _reference  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (keys per tile, warps, through tl.dot); the first is the reference the others are checked against
VARIANTS = [(16, 4, False), (32, 4, False), (64, 4, False), (64, 8, False), (32, 4, True), (64, 4, True), (64, 8, True), (128, 8, True)]


def cases() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(0)
    rand = lambda n, lo, hi: torch.randint(lo, hi, (n,), generator=g).tolist()  # noqa: E731
    return {
        "1 row, 192 keys": [192],
        "64 rows, 96-224 keys": rand(64, 96, 224),
        "256 rows, 96-224 keys": rand(256, 96, 224),
        "256 rows, 400-600 keys": rand(256, 400, 600),
        "prompt chunk of 2048": list(range(1, 2049)),  # one request: every row shares its block table
    }


def make_case(lens: list[int]):
    if lens != list(range(1, len(lens) + 1)):
        return _case(HEADS, KV_HEADS, HEAD_DIM, lens, torch.bfloat16, seed=1)
    q, k, v, table, _ = _case(HEADS, KV_HEADS, HEAD_DIM, [len(lens)], torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    return q, k, v, table.expand(len(lens), -1).contiguous(), torch.tensor(lens, dtype=torch.int64)


def main() -> int:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    for name, lens in cases().items():
        q, k, v, table, context_lens = make_case(lens)
        q, k, v, table, context_lens = (t.cuda() for t in (q, k, v, table, context_lens))
        rows = torch.arange(len(lens), device="cuda")
        scale = HEAD_DIM**-0.5
        base = None
        results[name] = {}
        for tile, warps, use_dot in VARIANTS:
            fn = triton_attention_kernel("cuda", torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM, BLOCK, tile, warps, use_dot)
            label = f"{'dot ' if use_dot else ''}tile {tile}, {warps} warps"
            out = torch.full((len(lens), HEADS * HEAD_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
            call = lambda: fn(q, k, v, table, rows, context_lens, 0, BLOCK, out, scale)  # noqa: E731
            call()
            torch.cuda.synchronize()
            got = out.float().cpu()
            assert not got.isnan().any(), f"{name} {label}: rows left unwritten"
            if base is None:
                base = got
                if len(lens) == 64:
                    ref = _reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), context_lens.cpu(), scale)
                    rel = ((got.double() - ref).norm() / ref.norm()).item()
                    assert rel < 1e-2, f"{name}: relative error {rel:.2e} against float64"
            rel = ((got - base).norm() / base.norm()).item()
            assert rel < 1e-2, f"{name} {label}: {rel:.2e} from the one-block tile"
            us = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median") * 1e3
            results[name][label] = round(us, 2)
    variants = list(next(iter(results.values())))
    print("us per launch (median of graph replays); one layer's attention")
    print(f"{'case':26s}" + "".join(f"{v:>22s}" for v in variants))
    for name, row in results.items():
        print(f"{name:26s}" + "".join(f"{row[v]:22.2f}" for v in variants))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
