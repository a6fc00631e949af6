"""What float32 logits cost a decode step, against bfloat16 ones, in one interleaved run.

    python -m asyncpp.bench.logits_cost [--config configs/default.toml] [--batch-sizes 1,64] [--repeat 5]

The in-process `Engine` (pp=1, one thread, as `step_cost`) times decode steps of
B requests with the head writing float32 logits (the default: the sampler reads
them as they are) and with the same head rounding them to bfloat16 (what a
bfloat16 model did before), by turns, `--repeat` times per batch size. The
extra cost is the head's wider output and the sampler reading twice the bytes;
each repetition's ratio is taken on its own pair, then their median. Only heads
that can write either (`out_dtype`: native and `linear_bf16` heads) can be
compared; a float32 model has nothing to compare.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from asyncpp.bench.step_cost import DEFAULT_CONFIG, measure
from asyncpp.config import load_config
from asyncpp.engine.engine import Engine

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.logits_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--num-steps", type=int, default=20, help="timed decode steps per measurement")
    ap.add_argument("--repeat", type=int, default=5, help="bfloat16 / float32 pairs per batch size")
    args = ap.parse_args(argv)
    sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    base = load_config(args.config)
    config = base.replace(
        parallel={"pp_size": 1, "layer_split": (), "num_threads": 1},
        scheduler={"max_num_seqs": max(sizes), "max_num_batched_tokens": max(4 * max(sizes), 512)},
        cache={"kv_cache_memory_mb": max(base.cache.kv_cache_memory_mb, 1024, 4 * max(sizes))},
    )
    engine = Engine(config)
    head = engine.executor.runners[-1].model.lm_head
    if engine.compute_plan.dtype != "bfloat16" or getattr(head, "out_dtype", None) != torch.float32:
        print(f"a {engine.compute_plan.dtype} model's head ({type(head).__name__}) cannot write both dtypes: nothing to compare")
        return 1
    measure(engine, min(sizes), 3)  # warm-up
    print(f"{'batch':>6} {'bf16 step ms':>13} {'f32 step ms':>12} {'f32 / bf16 per pair, median [range]':>38}")
    for size in sizes:
        times: dict[str, list[float]] = {name: [] for name in DTYPES}
        for _ in range(args.repeat):
            for name, dtype in DTYPES.items():
                head.out_dtype = dtype
                times[name].append(measure(engine, size, args.num_steps).step_ms)
        head.out_dtype = torch.float32
        ratios = sorted(f / b for f, b in zip(times["float32"], times["bfloat16"]))
        print(
            f"{size:>6} {statistics.median(times['bfloat16']):>13.3f} {statistics.median(times['float32']):>12.3f} "
            f"{statistics.median(ratios):>26.4f}x [{ratios[0]:.4f}-{ratios[-1]:.4f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
