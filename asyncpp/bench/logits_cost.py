"""What float32 logits cost a decode step, against bfloat16 ones, in one interleaved run.

    python -m asyncpp.bench.logits_cost [--config configs/default.toml] [--batch-sizes 1,64] [--num-steps 200]

The in-process `Engine` (pp=1, one thread, as `step_cost`) runs decode steps of
B requests, the head writing float32 logits (the default: the sampler reads
them as they are) or, by turns, the same head rounding them to bfloat16 (what a
bfloat16 model did before): steps alternate A B B A, so a drift of the machine
or the growing context falls on both alike. Each step is timed in this thread's
CPU time (one torch thread: the step's whole work; what a shared VM's
hypervisor steals is left out). The extra cost is the head's wider output and
the sampler reading twice the bytes: the report gives both medians and the
median of the per-pair ratios. Only heads that can write either (`out_dtype`:
native and `linear_bf16` heads, bfloat16 models) can be compared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncpp.bench.prompts import synthetic_prompts
from asyncpp.bench.step_cost import DEFAULT_CONFIG, decode_engine
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams

ORDER = (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)  # A B B A


def paired_steps(engine: Engine, head, batch_size: int, num_steps: int) -> tuple[list[float], list[float]]:
    """(bfloat16 step seconds, float32 step seconds) of `num_steps` decode steps of `batch_size`
    requests, the head's output dtype switched in `ORDER`."""
    params = SamplingParams(max_tokens=engine.capacity.max_model_len // 2, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in synthetic_prompts(batch_size, 8, 16, batch_size)]
    requests = [engine.scheduler.get_request(i) for i in ids]
    while any(r.num_output_tokens == 0 for r in requests):  # prompts done
        engine.step()
    times: dict[torch.dtype, list[float]] = {torch.bfloat16: [], torch.float32: []}
    for i in range(num_steps):
        head.out_dtype = ORDER[i % len(ORDER)]
        num_before = sum(r.num_output_tokens for r in requests)
        t0 = time.thread_time()
        engine.step()
        times[head.out_dtype].append(time.thread_time() - t0)
        if sum(r.num_output_tokens for r in requests) - num_before != batch_size:
            raise RuntimeError("a timed step did not decode every request (KV cache too small?)")
    head.out_dtype = torch.float32
    for request_id in ids:
        engine.abort(request_id)
    return times[torch.bfloat16], times[torch.float32]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.logits_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--num-steps", type=int, default=200, help="timed decode steps per batch size (half each)")
    args = ap.parse_args(argv)
    sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    engine = decode_engine(args.config, sizes)
    head = getattr(engine.executor.runners[-1].model.lm_head, "head", None)  # inside `ReusedRows`
    if engine.compute_plan.dtype != "bfloat16" or getattr(head, "out_dtype", None) != torch.float32:
        print(f"a {engine.compute_plan.dtype} model's head cannot write both dtypes: nothing to compare")
        return 1
    paired_steps(engine, head, min(sizes), 4)  # warm-up
    print(f"{'batch':>6} {'bf16 step ms':>13} {'f32 step ms':>12} {'f32 / bf16 per pair, median [quartiles]':>42}")
    for size in sizes:
        bf16, f32 = paired_steps(engine, head, size, max(4, args.num_steps))
        ratios = sorted(f / b for f, b in zip(f32, bf16))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        print(
            f"{size:>6} {statistics.median(bf16) * 1e3:>13.3f} {statistics.median(f32) * 1e3:>12.3f} "
            f"{statistics.median(ratios):>28.4f}x [{q1:.4f}-{q3:.4f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
