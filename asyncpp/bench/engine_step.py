"""`python -m asyncpp.bench.engine_step`: the engine's host time per decode step, without a model.

On a GPU the engine's per-step work bounds the step once the device's work
overlaps it (async output): on an H200 at 256 requests scheduling and
applying the outputs took 5.0 ms a step, then 3.2 ms after the cuts this
measured as 5.65 -> 3.52 ms on a Zen 4 (2026-11-28), against the plain
loop's 2.9 ms for the whole step. This measures
that work alone, on any machine: for each batch size B (`--batch-sizes`),
an `EngineCore` built from `--config` (its tokenizer, scheduler and output
processor; no model, no stages) admits B prompts of `--input-len` tokens,
runs their prefill steps, then times `--steps` decode steps as the pipeline
runtime runs them with async scheduling: the next plan is scheduled (with
placeholders) before the previous step's tokens are applied, each plan is
encoded as `StageGroup.broadcast` encodes it, the previous step's fake
sampled tokens (drawn before timing; `ignore_eos`) are applied by
`process_output`, and its deltas are encoded per client as `ClientPort.deliver`
does. The start-up heap is frozen first, as the launched engine freezes it
(`asyncpp.runtime.gc_heap`; `--no-gc-freeze` to leave it). Prints ms per
step of each part, and us per request.

    python -m asyncpp.bench.engine_step [--batch-sizes 64,256] [--config configs/default.toml]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections import defaultdict
from pathlib import Path

from asyncpp.config import load_config
from asyncpp.engine.engine import EngineCore
from asyncpp.engine.startup import resolve_capacity
from asyncpp.runtime.gc_heap import freeze_startup_heap
from asyncpp.sampling.params import SamplingParams
from asyncpp.tokenizer.loader import load_tokenizer
from asyncpp.weights import read_arch
from asyncpp.wire.client_msgs import RequestDeltas
from asyncpp.wire import stage_msgs  # noqa: F401 - registers StepPlan on the wire
from asyncpp.wire.codec import encode
from asyncpp.worker.outputs import ModelRunnerOutput

PARTS = ("schedule", "encode_plan", "process_output", "encode_deltas")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.engine_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=100, help="decode steps timed per batch size")
    ap.add_argument("--clients", type=int, default=1, help="client connections the deltas are split over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gc-freeze", action="store_true", help="leave the start-up heap to the GC (the launched engine freezes it)")
    ap.add_argument("--result-json")
    return ap.parse_args(argv)


def build_core(config_path: str, batch_size: int, input_len: int, steps: int) -> EngineCore:
    config = load_config(config_path)
    need = max(config.model.max_model_len, input_len + steps + 8)
    config = config.replace(
        # Every prompt in one prefill step: the decode steps timed are the same whatever the budget.
        scheduler={"max_num_seqs": batch_size, "max_num_batched_tokens": batch_size * input_len},
        model={"max_model_len": need},
        cache={"num_kv_blocks_override": batch_size * (-(-need // config.cache.block_size) + 1)},
        parallel={"pp_size": 1},
    )  # fmt: skip
    arch = read_arch(config.model.source, config.model.path_or_none)
    tokenizer = load_tokenizer(config.model.source, config.model.path_or_none, arch.vocab_size)
    capacity = resolve_capacity(config, arch, config.model.dtype if config.model.dtype != "auto" else "float32")
    return EngineCore(config, arch, tokenizer, capacity)


def run(core: EngineCore, batch_size: int, args) -> dict[str, float]:
    rng = random.Random(args.seed)
    vocab = core.arch.vocab_size
    params = SamplingParams(max_tokens=args.steps + 16, temperature=0.0, ignore_eos=True)
    for _ in range(batch_size):
        core.add_request([rng.randrange(100, vocab) for _ in range(args.input_len)], params)
    fake = [rng.randrange(100, vocab) for _ in range(4096)]  # ignore_eos: no token stops a request
    clients = [f"client-{i}".encode() for i in range(args.clients)]

    def output_of(plan) -> ModelRunnerOutput:
        ids = [r.request_id for r in plan.scheduled if r.do_sample]
        tokens = [[fake[(plan.step_id * 7 + i) % len(fake)]] for i in range(len(ids))]
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=tokens, logprobs=[None] * len(ids))

    def deliver(outputs) -> None:
        by_client = defaultdict(list)
        for i, out in enumerate(outputs):
            by_client[clients[i % len(clients)]].append(out)
        for outs in by_client.values():
            encode(RequestDeltas.of(outs))

    while True:  # prefill, synchronously, until every request decodes
        plan = core.scheduler.schedule()
        core.process_output(plan, [output_of(plan)])
        if all(r.num_tokens == 1 for r in plan.scheduled) and len(plan.scheduled) == batch_size:
            break
    totals = dict.fromkeys(PARTS, 0.0)
    clock = time.perf_counter
    held = core.scheduler.schedule()
    for _ in range(args.steps):
        t0 = clock()
        plan = core.scheduler.schedule(after_step_id=held.step_id)
        t1 = clock()
        encode(plan)
        t2 = clock()
        outputs = core.process_output(held, [output_of(held)])
        t3 = clock()
        deliver(outputs)
        t4 = clock()
        for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            totals[part] += dt
        held = plan
    per_step = {part: totals[part] / args.steps * 1e3 for part in PARTS}
    per_step["total"] = sum(per_step.values())
    per_step["us_per_request"] = per_step["total"] / batch_size * 1e3
    return per_step


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {}
    print(f"{'B':>5}" + "".join(f"{p:>16}" for p in (*PARTS, "total")) + f"{'us/request':>12}   (ms per decode step)")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        core = build_core(args.config, batch_size, args.input_len, args.steps)
        if not args.no_gc_freeze:
            freeze_startup_heap()  # as the launched engine does once it is up
        try:
            r = results[batch_size] = run(core, batch_size, args)
        finally:
            gc.unfreeze()  # the next batch size's engine is built anew
        print(f"{batch_size:>5}" + "".join(f"{r[p]:16.3f}" for p in (*PARTS, "total")) + f"{r['us_per_request']:12.2f}", flush=True)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
