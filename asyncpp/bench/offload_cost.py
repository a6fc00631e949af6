"""`python -m asyncpp.bench.offload_cost`: what the offload connector costs when nothing is reused.

The in-process engine (every stage in this process, so one CPU clock sees
all of their work) serves the same prompts with `kv_transfer.connector` set
to "none" and to "offload", alternating which goes first each round. Prompts
are random words, so no prefix is ever shared: the connector only saves
every full block. Per run: this process's CPU time per output token (the
stages, their transfer threads, the scheduler) and output tok/s; then the
offload / none ratio of each round and their median (min - max). A warm-up
request runs before each measured batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from asyncpp.config import load_config
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams

_WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be or has had not but".split()


def measure(config, connector: str, prompts: list[str], params: SamplingParams) -> tuple[float, float]:
    """(CPU microseconds per output token, output tok/s) of one engine serving `prompts`."""
    engine = Engine(config.replace(kv_transfer=dataclasses.replace(config.kv_transfer, connector=connector)))
    try:
        engine.generate(prompts[:1], params)  # warm-up
        cpu0, t0 = time.process_time(), time.perf_counter()
        outputs = engine.generate(prompts, params)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        engine.close()
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return cpu_s / num_tokens * 1e6, num_tokens / wall_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncpp.bench.offload_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.toml")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-words", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = load_config(args.config)
    # One process runs every stage: no threads lent or pinned across stage boundaries.
    config = base.replace(parallel=dataclasses.replace(base.parallel, lend_idle_threads=False, pin_threads=False))
    torch.set_num_threads(config.parallel.num_threads)
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(args.input_words)) for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results: dict[str, list[tuple[float, float]]] = {"none": [], "offload": []}
    for r in range(args.rounds):
        for connector in ("none", "offload") if r % 2 == 0 else ("offload", "none"):
            us, tps = measure(config, connector, prompts, params)
            results[connector].append((us, tps))
            print(f"round {r} {connector:8s} {us:8.1f} us CPU per token  {tps:7.1f} tok/s", flush=True)
    for what, index in (("CPU per token", 0), ("output tok/s", 1)):
        ratios = [o[index] / n[index] for n, o in zip(results["none"], results["offload"])]
        print(f"offload / none {what}: {statistics.median(ratios):.3f}x ({min(ratios):.3f} - {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
