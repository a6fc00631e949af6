"""Decode step cost against batch size, and the pipeline speed-up it allows.

    python -m asyncpp.bench.step_cost [--config configs/default.toml] [--batch-sizes 8,16,32,64,128,256]

Runs the in-process `Engine` (pp=1, one thread) and times decode steps of B
requests for each B. At concurrency C a pp=2 stage runs steps of C/2
requests through half the model while pp=1 runs steps of C requests through
all of it, so with both stages always busy pp=2 / pp=1 output throughput is
at most t(C) / t(C/2): below 2 whenever a step has a cost its size does not
share (streaming the weights from memory, per-step Python). This is the
ceiling the serving benchmark's pp=2 vs pp=1 ratio is measured against.

`--split` also says where each step's time goes: the layers' linears, their
attention and the rest of the layers (norms, RoPE, KV writes, SiLU * up),
counted inside the layer stack's C call, and what is outside it (embedding,
lm_head, sampling, the engine's Python), per decode step of B requests and
per prompt step of `--prefill-tokens` tokens (one new prompt per step).
`--min-words` / `--max-words` set the decode steps' prompts, as in
`bench.offline` (default 8-16: short contexts; 64 and 64 is the peers'
workload, whose decode steps attend over about 100 positions a request, as
in serving).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

from asyncpp.bench.prompts import synthetic_prompts
from asyncpp.config import load_config
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams

DEFAULT_CONFIG = "configs/default.toml"


@dataclass(frozen=True)
class StepCost:
    batch_size: int
    step_ms: float
    split_ms: dict[str, float] = field(default_factory=dict)  # per step: linears, attention, other, outside

    @property
    def ms_per_token(self) -> float:
        return self.step_ms / self.batch_size


def pp2_ceiling(costs: dict[int, StepCost], concurrency: int) -> float | None:
    """Most pp=2 / pp=1 output throughput at `concurrency`: t(C) / t(C/2); None if either is missing."""
    full, half = costs.get(concurrency), costs.get(concurrency // 2)
    if full is None or half is None or concurrency % 2:
        return None
    return full.step_ms / half.step_ms


def measure(
    engine: Engine,
    batch_size: int,
    num_steps: int,
    seed: int = 0,
    split: bool = False,
    prompt_words: tuple[int, int] = (8, 16),
) -> StepCost:
    """Median decode step time with `batch_size` requests running (prefills excluded); `split`: the
    timed steps' mean split too. The prompts have `prompt_words` (min, max) random words each, so the
    decode steps attend over about that many positions (the peers' workload: 64).

    The requests may generate far more tokens than are timed, so none finishes while other
    prompts are still being prefilled (many steps with a large batch and a small token
    budget); they are aborted once the timed steps are done.
    """
    params = SamplingParams(max_tokens=engine.capacity.max_model_len // 2, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in synthetic_prompts(batch_size, *prompt_words, seed)]
    requests = [engine.scheduler.get_request(i) for i in ids]  # live: the scheduler updates them
    while any(r.num_output_tokens == 0 for r in requests):  # prompts done
        engine.step()
    times = []
    stack = _start_split(engine) if split else None
    for _ in range(num_steps):
        num_before = sum(r.num_output_tokens for r in requests)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        num_decoded = sum(r.num_output_tokens for r in requests) - num_before
        if num_decoded != batch_size:
            raise RuntimeError(f"a timed step decoded {num_decoded} of {batch_size} requests (KV cache too small?)")
    split_ms = _end_split(stack, times)
    for request_id in ids:
        engine.abort(request_id)
    times.sort()
    return StepCost(batch_size, times[len(times) // 2] * 1e3, split_ms)


def measure_prefill(engine: Engine, num_tokens: int, num_steps: int, seed: int = 0) -> StepCost:
    """Median time of a step that prefills one new prompt of `num_tokens` tokens (nothing else running,
    no prefix shared; `scheduler.max_num_batched_tokens` must hold it), and the timed steps' mean split."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times, spent = [], {}
    stack = _start_split(engine)
    for i in range(num_steps):
        words = synthetic_prompts(1, num_tokens, num_tokens, seed + i)[0]
        engine.add_request(engine.tokenizer.encode(words)[:num_tokens], params)
        if stack is not None:
            stack.take_times()  # from here: the timed step only
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if stack is not None:
            for kind, seconds in stack.take_times().items():
                spent[kind] = spent.get(kind, 0.0) + seconds
        while engine.has_unfinished_requests():
            engine.step()  # not timed: the request finishing
    split_ms = _end_split(stack, times, spent)
    times.sort()
    return StepCost(num_tokens, times[len(times) // 2] * 1e3, split_ms)


def _start_split(engine: Engine):
    """The in-process engine's layer stack, counting from now (None: the layers run without one)."""
    stack = engine.executor.runners[0].model.stack
    if stack is not None:
        stack.set_timing(True)
        stack.take_times()
    return stack


def _end_split(stack, times: list[float], spent: dict[str, float] | None = None) -> dict[str, float]:
    """Mean ms per timed step in the stack's linears, attention and other work (`spent`, seconds, or the
    stack's counts since `_start_split`), and outside the stack."""
    if stack is None:
        return {}
    spent = spent if spent is not None else stack.take_times()
    stack.set_timing(False)
    split = {kind: seconds * 1e3 / len(times) for kind, seconds in spent.items()}
    split["outside"] = sum(times) * 1e3 / len(times) - sum(split.values())
    return split


def split_text(cost: StepCost) -> str:
    """`linears 61% (3.1 ms), attention 12% ...` of a step's mean time."""
    total = sum(cost.split_ms.values())
    return ", ".join(f"{k} {100 * v / total:.0f}% ({v:.2f} ms)" for k, v in cost.split_ms.items()) if total else "-"


def decode_engine(config_path: str, sizes: list[int], prefill_tokens: int = 0) -> Engine:
    """The in-process engine the decode-step benchmarks time: the config at pp=1 and one thread, with
    room to prefill the largest batch in a few steps (and a prompt of `prefill_tokens` in one) and to hold
    its KV (4 MiB per request)."""
    base = load_config(config_path)
    config = base.replace(
        parallel={"pp_size": 1, "layer_split": (), "num_threads": 1},
        scheduler={"max_num_seqs": max(sizes), "max_num_batched_tokens": max(4 * max(sizes), prefill_tokens, 512)},
        cache={"kv_cache_memory_mb": max(base.cache.kv_cache_memory_mb, 1024, 4 * max(sizes))},
    )
    return Engine(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.step_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--batch-sizes", default="8,16,32,64,128,256")
    ap.add_argument("--num-steps", type=int, default=20, help="timed decode steps per batch size")
    ap.add_argument("--split", action="store_true", help="also the time split of each step (layer stack counters)")
    ap.add_argument("--prefill-tokens", default="256,1024", help="with --split: prompt steps of these many tokens")
    ap.add_argument("--min-words", type=int, default=8, help="fewest words per prompt of the decode steps")
    ap.add_argument("--max-words", type=int, default=16, help="most words per prompt of the decode steps")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    sizes = _ints(args.batch_sizes)
    if not 1 <= args.min_words <= args.max_words:
        ap.error(f"--min-words and --max-words need 1 <= min <= max, got {args.min_words} and {args.max_words}")
    prompt_words = (args.min_words, args.max_words)
    engine = decode_engine(args.config, sizes, max(_ints(args.prefill_tokens)) if args.split else 0)
    measure(engine, min(sizes), 3, prompt_words=prompt_words)  # warm-up
    costs = {b: measure(engine, b, args.num_steps, split=args.split, prompt_words=prompt_words) for b in sizes}
    print(f"{'batch':>6} {'step ms':>9} {'ms/token':>9} {'pp=2 ceiling at concurrency':>28}")
    for b, cost in costs.items():
        ceiling = pp2_ceiling(costs, b)
        shown = f"{ceiling:.2f}x at {b}" if ceiling is not None else "-"
        print(f"{b:>6} {cost.step_ms:>9.2f} {cost.ms_per_token:>9.3f} {shown:>28}")
    prefills = {}
    if args.split:
        prefills = {n: measure_prefill(engine, n, max(3, args.num_steps // 4)) for n in _ints(args.prefill_tokens)}
        print("where a step's time goes (mean of the timed steps; outside = embedding, lm_head, sampling, Python):")
        for b, cost in costs.items():
            print(f"  decode {b:>4} requests: {split_text(cost)}")
        for n, cost in prefills.items():
            print(f"  prompt {n:>4} tokens:   {split_text(cost)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": args.config,
                    "step_ms": {str(b): c.step_ms for b, c in costs.items()},
                    "pp2_ceiling": {str(b): pp2_ceiling(costs, b) for b in sizes},
                    "decode_split_ms": {str(b): c.split_ms for b, c in costs.items()},
                    "prefill_split_ms": {str(n): c.split_ms for n, c in prefills.items()},
                },
                f,
                indent=2,
            )
    return 0


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",")})


if __name__ == "__main__":
    raise SystemExit(main())
