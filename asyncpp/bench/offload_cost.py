"""`python -m asyncpp.bench.offload_cost`: what the offload connector costs when nothing is reused.

The in-process engine (every stage in this process, so one CPU clock sees
all of their work) serves the same prompts with `kv_transfer.connector` set
to "none" and to "offload", alternating which goes first each round. Prompts
are random words, so no prefix is ever shared: the connector only saves
every full block. Per run: this process's CPU time per output token (the
stages, their transfer threads, the scheduler) and output tok/s; then the
offload / none ratio of each round and their median (min - max). A warm-up
request runs before each measured batch. The quiet measure: every method of
the connector (its engine half, each stage's half and the transfer thread's
jobs) is timed on its own thread's CPU clock, which other processes' load
does not move; its sum per token, against a token's CPU without the
connector, is the connector's direct cost (not the cache it disturbs, which
only the A/B ratios can show).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import threading
import time

import torch

from asyncpp.config import load_config
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams

_WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had", "not", "but"]


class ThreadCpu:
    """CPU seconds spent inside wrapped methods, each call measured on its own thread's clock
    (`time.thread_time`), so other processes' load and this process's other threads stay out."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._depth = threading.local()

    def wrap(self, obj, names) -> None:
        for name in names:
            method = getattr(obj, name, None)
            if callable(method):
                setattr(obj, name, self._timed(method))

    def _timed(self, method):
        def timed(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            t0 = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:  # a wrapped method calling another counts once
                    with self._lock:
                        self.seconds += time.thread_time() - t0

        return timed


# What the connector runs: the engine's half, each stage's half (on the stage's thread) and the
# offload worker's transfer-thread jobs.
_SCHEDULER_METHODS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "has_unsent_metadata",
    "update_connector_output", "request_finished",
)  # fmt: skip
_WORKER_METHODS = (
    "bind_connector_metadata", "clear_connector_metadata", "start_load_kv", "save_kv", "wait_for_save",
    "handle_preemptions", "get_finished", "get_failed_sending", "get_block_ids_with_load_errors", "get_stats",
    "_load", "_save",
)  # fmt: skip


def measure(config, connector: str, prompts: list[str], params: SamplingParams) -> tuple[float, float, float]:
    """(CPU microseconds per output token, output tok/s, the connector's own CPU microseconds per
    output token) of one engine serving `prompts`."""
    engine = Engine(config.replace(kv_transfer=dataclasses.replace(config.kv_transfer, connector=connector)))
    connector_cpu = ThreadCpu()
    if engine.kv_connector is not None:
        connector_cpu.wrap(engine.kv_connector, _SCHEDULER_METHODS)
        for runner in engine.executor.runners:
            connector_cpu.wrap(runner.kv_connector.connector, _WORKER_METHODS)
    try:
        engine.generate(prompts[:1], params)  # warm-up
        connector_cpu.seconds = 0.0
        cpu0, t0 = time.process_time(), time.perf_counter()
        outputs = engine.generate(prompts, params)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        engine.close()
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return cpu_s / num_tokens * 1e6, num_tokens / wall_s, connector_cpu.seconds / num_tokens * 1e6


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
    # One process runs every stage: no threads lent or pinned across stage boundaries. A connector
    # turns layer shifting off (`shift_layers_off`): the baseline runs without it too, so that
    # only the connector differs between the two.
    parallel = dataclasses.replace(base.parallel, lend_idle_threads=False, pin_threads=False, shift_layers=0)
    config = base.replace(parallel=parallel)
    torch.set_num_threads(config.parallel.num_threads)
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(args.input_words)) for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results: dict[str, list[tuple[float, float, float]]] = {"none": [], "offload": []}
    for r in range(args.rounds):
        for connector in ("none", "offload") if r % 2 == 0 else ("offload", "none"):
            us, tps, connector_us = measure(config, connector, prompts, params)
            results[connector].append((us, tps, connector_us))
            print(
                f"round {r} {connector:8s} {us:8.1f} us CPU per token  {tps:7.1f} tok/s  "
                f"connector {connector_us:6.1f} us per token",
                flush=True,
            )
    for what, index in (("CPU per token", 0), ("output tok/s", 1)):
        ratios = [o[index] / n[index] for n, o in zip(results["none"], results["offload"])]
        print(f"offload / none {what}: {statistics.median(ratios):.3f}x ({min(ratios):.3f} - {max(ratios):.3f})")
    # The quiet measure: the connector's own CPU (its threads' clocks) against all the CPU a token
    # takes without it, round by round.
    shares = [o[2] / n[0] * 100 for n, o in zip(results["none"], results["offload"])]
    print(
        f"offload connector's own CPU, % of a token's CPU without it: {statistics.median(shares):.2f}% "
        f"({min(shares):.2f} - {max(shares):.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
