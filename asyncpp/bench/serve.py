"""`python -m asyncpp.bench`: online serving benchmark, in the style of `vllm bench serve`.

    python -m asyncpp.bench --config configs/default.toml --num-prompts 64 --max-concurrency 32 \\
        --random-input-len 64 --random-output-len 64 \\
        --runs "pp=2,threads=1;pp=1,threads=1;pp=1,threads=2" --compare transformers \\
        --result-json /tmp/bench_serve.json

    # KV offload: bursts of 8 requests on 4 prefixes of 1024 words, with and without the connector
    python -m asyncpp.bench --num-prompts 64 --shared-prefix-len 1024 --shared-prefix-groups 4 \\
        --random-input-len 32 --burst-size 8 --burst-gap-s 0.5 \\
        --runs 'kv_transfer.connector="none";kv_transfer.connector="offload"'

    # Speculative decoding: prompts that repeat a passage, with and without n-gram drafting
    python -m asyncpp.bench --workload repetitive --random-input-len 200 --random-output-len 128 \\
        --runs 'speculative.method="none";speculative.method="ngram"'

    # Two revisions, interleaved: the runs' engines import asyncpp from different checkouts
    git worktree add /tmp/asyncpp-before HEAD~5
    python -m asyncpp.bench --runs "tree=/tmp/asyncpp-before;tree=." --repeat 3

Each run launches the engine (`python -m asyncpp.launch`) with the config's
overrides, warms it up, sends the same requests through `AsyncClient` and
shuts it down (SIGTERM, wait) whatever happens. The machine is shared and
noisy, so every figure is read against the baseline run (`--baseline`,
default the first) measured in the same invocation: the ratio lines say
"other run METRIC = R x baseline" (other / baseline, as the docs' tables). `--repeat N` runs the whole list N times,
interleaved (A B A B ...), so that a slow spell of the machine hits every run
alike; ratios are then taken within each repetition and summarised as their
median and range. `--compare transformers` adds the same requests through
`transformers` generate (static batches, best batch size).

`--shared-prefix-len` opens every prompt with one of `--shared-prefix-groups`
prefixes (asyncpp/bench/shared_prefix.py) and splits TTFT into cold (first
burst of a prefix) and warm; `--burst-size` sends the requests in bursts, one
after the other (asyncpp/bench/load.py). A run whose engine has a KV
connector gets its transfers and prefix hits (asyncpp/bench/kv_report.py).

`--workload repetitive` sends prompts that show a passage twice
(asyncpp/bench/datasets.py); a run whose engine drafts gets its drafts and
acceptance (asyncpp/bench/spec_report.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import math
import os
import platform
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import uvloop

import asyncpp
from asyncpp.bench import report
from asyncpp.bench.compute_report import compute_section
from asyncpp.bench.cpu import window_cpu
from asyncpp.bench.datasets import BenchRequest, load_dataset, random_requests, repetitive_requests
from asyncpp.bench.engine_proc import EngineStartError, launched_engine
from asyncpp.bench.kv_report import kv_section
from asyncpp.bench.load import LoadResult, run_load
from asyncpp.bench.openai_backend import OpenAIBackend
from asyncpp.bench.memcpy import handoff_nbytes, time_memcpy_us
from asyncpp.bench.metrics import busy_fractions, ratio_rows, serving_metrics, summarize_ratios
from asyncpp.bench.runs import RunSpec, parse_runs, run_sections, to_toml, validate
from asyncpp.bench.shared_prefix import cold_warm_ttft, prefix_group, shared_prefix_requests
from asyncpp.bench.spec_report import spec_section
from asyncpp.bench.stage_kill import recovery_section
from asyncpp.bench.structured_report import grammar_section
from asyncpp.engine.compute_plan import resolve_compute_plan
from asyncpp.kernels.isa import cpu_info
from asyncpp.profiling import profiled
from asyncpp.progress import Progress

DEFAULT_CONFIG = "configs/default.toml"
HF_KEYS = ("request_throughput", "output_throughput")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m asyncpp.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="base deployment TOML (default: %(default)s)")
    ap.add_argument("--runs", help='engine variants, e.g. "pp=2,threads=1;pp=1,threads=1" (keys: pp, threads, section.key)')
    ap.add_argument("--baseline", default="1", help="run every other run is compared with: label or 1-based index")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the list this many times, interleaved; ratios per repetition, then median (min-max)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, help="at most this many requests in flight (default: no limit)")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    ap.add_argument("--random-input-len", type=int, default=64, help="prompt length in words")
    ap.add_argument("--random-output-len", type=int, default=64, help="output length in tokens")
    ap.add_argument("--workload", choices=("random", "repetitive"), default="random",
                    help="synthetic prompts: random words, or repetitive: a passage of --random-input-len words, "
                         "the passage again lightly edited, then its first words (default: %(default)s)")
    ap.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths drawn from len*(1 -/+ ratio)")
    ap.add_argument("--shared-prefix-len", type=int, default=0,
                    help="open each prompt with a shared prefix of this many words (0: off); "
                         "the rest is --random-input-len random words of its own")
    ap.add_argument("--shared-prefix-groups", type=int, default=1,
                    help="distinct prefixes: request i gets prefix (i // burst size) %% groups (default: 1)")
    ap.add_argument("--burst-size", type=int,
                    help="send the requests this many at a time; a burst starts when the last one has finished "
                         "(default: off)")
    ap.add_argument("--burst-gap-s", type=float, default=0.5,
                    help="with --burst-size: seconds between bursts, counted in the duration (default: %(default)s)")
    ap.add_argument("--dataset", help='JSON lines with "prompt" and optional "output_len" (instead of random)')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="generate exactly the output length (default: on)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--backend", choices=("native", "openai"), default="native",
                    help="how requests reach each launched engine: the msgpack client or the OpenAI HTTP API")
    ap.add_argument("--base-url", help="benchmark this OpenAI-compatible server (vLLM, llama-server, ...) "
                    "instead of launching engines, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="with --base-url: the model name to send (default: the first of /v1/models)")
    ap.add_argument("--api-key", help="with --base-url: sent as Authorization: Bearer")
    ap.add_argument("--compare", choices=("transformers",), help="also run the requests through transformers generate")
    ap.add_argument("--compare-batch-sizes", default="16,all", help="transformers static batch sizes (all = every prompt)")
    ap.add_argument("--compare-threads", type=int, help="transformers torch threads (default: the baseline run's cores)")
    ap.add_argument("--result-json", help="write every figure, the arguments and the machine to this file")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for an engine to start")
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1) or args.repeat < 1:
        ap.error("--num-prompts, --max-concurrency and --repeat must be >= 1")
    if args.shared_prefix_len < 0 or args.shared_prefix_groups < 1:
        ap.error("--shared-prefix-len must be >= 0 and --shared-prefix-groups >= 1")
    if args.shared_prefix_len and args.dataset:
        ap.error("--shared-prefix-len builds its own prompts: not with --dataset")
    if args.workload != "random" and (args.dataset or args.shared_prefix_len):
        ap.error("--workload builds its own prompts: not with --dataset or --shared-prefix-len")
    if args.burst_size is not None and (args.burst_size < 1 or args.burst_gap_s < 0):
        ap.error("--burst-size must be >= 1 and --burst-gap-s >= 0")
    if args.burst_size and math.isfinite(args.request_rate):
        ap.error("--burst-size sends each burst at once: not with --request-rate")
    return args


def make_requests(args: argparse.Namespace) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(measured requests, warm-up requests); warm-up prompts differ so they do not seed the prefix cache."""
    if args.dataset:
        requests = load_dataset(args.dataset, args.num_prompts, args.random_output_len)
    elif args.shared_prefix_len:
        requests = shared_prefix_requests(
            args.num_prompts, args.shared_prefix_len, args.shared_prefix_groups, args.random_input_len,
            args.random_output_len, burst_size=args.burst_size, range_ratio=args.random_range_ratio, seed=args.seed,
        )
    else:
        make = repetitive_requests if args.workload == "repetitive" else random_requests
        requests = make(
            args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed
        )
    # As short as the shortest measured prompt, so warm-up cannot fail where the benchmark would not.
    # Its words come from its own seed: it shares no shared prefix, which stays cold until measured.
    num_words = min((len(r.prompt.split()) for r in requests if isinstance(r.prompt, str)), default=16)
    warmup = random_requests(2, num_words, 8, 0.0, args.seed + 1000)
    return requests, warmup


def bench_run(run: RunSpec, args: argparse.Namespace, requests, warmup, config_path: Path) -> dict[str, Any]:
    sections = run_sections(args.config, run)
    backend = run.backend(args.backend)
    if backend == "openai":
        sections.setdefault("server", {}).update(http_port=free_port(), http_host="127.0.0.1")
    config = validate(sections)
    config_path.write_text(to_toml(sections))
    bars: list[Progress] = []  # started when the measured requests start, not at engine launch
    engine_ctx = launched_engine(config_path, ready_timeout_s=args.ready_timeout, tree=run.tree())
    with engine_ctx as engine, profiled(f"client-{_slug(run.label)}"):
        try:
            # uvloop, like the engine: the client's own loop overhead is CPU taken from the stages.
            load = uvloop.run(
                run_load(
                    engine.address, requests, warmup,
                    backend=OpenAIBackend(f"http://127.0.0.1:{config.server.http_port}") if backend == "openai" else None,
                    max_concurrency=args.max_concurrency, request_rate=args.request_rate, seed=args.seed,
                    ignore_eos=args.ignore_eos, temperature=args.temperature,
                    burst_size=args.burst_size, burst_gap_s=args.burst_gap_s,
                    on_start=lambda: bars.append(Progress(len(requests), f"[{run.label}] requests", "req")),
                    on_done=lambda _: bars[0].update(),
                    kill=run.stage_kill(),
                    structured_outputs=run.structured_outputs(),
                )
            )
        finally:
            for bar in bars:
                bar.close()
    metrics = serving_metrics(load.records, load.duration_s)
    if args.shared_prefix_len:
        groups = [prefix_group(i, args.shared_prefix_groups, args.burst_size) for i in range(len(requests))]
        metrics |= cold_warm_ttft(load.records, groups)
    stages = stage_figures(load.stats_before, load.stats_after)
    after = load.stats_after
    compute = compute_section(after)
    # What the engine resolved "auto" to; the same resolution here if it did not say.
    dtype = compute["dtype"] if compute else resolve_compute_plan(config.model, config.stage_devices).dtype
    return {
        "label": run.label,
        "backend": backend,
        "tree": str(run.tree() or ""),
        "overrides": {k: v for k, v in run.overrides},
        "config": sections,
        "pp_size": config.parallel.pp_size,
        "num_threads": config.parallel.num_threads,
        "num_cores": config.parallel.pp_size * config.parallel.num_threads,
        "metrics": metrics,
        "dtype": dtype,  # resolved: the model's, the activations' and the KV cache's
        "compute": compute,
        "stages": stages,
        "cpu": cpu_section(load, metrics["total_output_tokens"]),
        "memcpy": memcpy_reference(config, dtype, metrics, stages["num_steps"]),
        "kv_transfer": kv_section(load.stats_before, load.stats_after),
        "spec_decode": spec_section(load.stats_before, load.stats_after, config.speculative.method),
        "engine": {
            "pid": engine.pid,
            "exit_code": engine.proc.returncode,
            "stage_pids": after.get("stage_pids", []),
            "run_id": after.get("run_id"),
        },
        "structured": (
            grammar_section(config, run.structured_outputs(), after) if run.structured_outputs() is not None else None
        ),
        "recovery": (
            recovery_section(load.records, load.killed_at, load.stats_before, after) if load.killed_at else None
        ),
        "requests": [r.to_dict() for r in load.records],
    }


def stage_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Busy fractions and steps over the measured window; hand-off percentiles as the engine keeps them."""
    return {
        "busy_fraction": busy_fractions(before, after),
        "busy_s": [b1 - b0 for b0, b1 in zip(before["stage_busy_s"], after["stage_busy_s"])],
        "window_s": after["uptime_s"] - before["uptime_s"],
        "num_steps": after["num_steps"] - before["num_steps"],
        "handoff_us_p50": after["handoff_us_p50"],
        "handoff_us_p99": after["handoff_us_p99"],
        "handoff_scope": "the engine's last 10000 steps, warm-up included",
    }


def cpu_section(load: LoadResult, num_output_tokens: int) -> dict[str, Any]:
    """CPU used over the measured window (between the two stats snapshots) by each process of the run."""
    before, after = load.stats_before, load.stats_after
    engine_window_s = after["uptime_s"] - before["uptime_s"]
    client_window_s = load.cpu_after.monotonic_s - load.cpu_before.monotonic_s
    machine = [load.cpu_before.machine_cpu_s, load.cpu_after.machine_cpu_s]
    busy, stolen = ([m[i] if m else None for m in machine] for i in (0, 1))
    return {
        "num_output_tokens": num_output_tokens,
        "machine_busy": window_cpu(*busy, client_window_s, num_output_tokens),
        "machine_stolen": window_cpu(*stolen, client_window_s, num_output_tokens),
        "engine": window_cpu(before.get("cpu_s"), after.get("cpu_s"), engine_window_s, num_output_tokens),
        "client": window_cpu(
            load.cpu_before.client_cpu_s, load.cpu_after.client_cpu_s, client_window_s, num_output_tokens
        ),
        "stages": [
            window_cpu(b, a, client_window_s, num_output_tokens)
            for b, a in zip(load.cpu_before.stage_cpu_s, load.cpu_after.stage_cpu_s)
        ],
    }


def memcpy_reference(config, dtype: str, metrics: dict[str, Any], num_steps: int) -> dict[str, Any]:
    """memcpy of a decode step (mean tokens sampled per step) and a prefill step (a full token budget),
    of activations in `dtype` (the resolved one)."""
    from asyncpp.weights import read_arch

    arch = read_arch(config.model.source, config.model.path_or_none)
    decode_tokens = max(1, round(metrics["total_output_tokens"] / max(1, num_steps)))
    prefill_tokens = max(1, min(config.scheduler.max_num_batched_tokens, metrics["total_input_tokens"]))
    out = {}
    for kind, num_tokens in (("decode", decode_tokens), ("prefill", prefill_tokens)):
        nbytes = handoff_nbytes(arch.hidden_size, num_tokens, dtype)
        out[kind] = {"num_tokens": num_tokens, **time_memcpy_us(nbytes, config.parallel.num_threads)}
    return out


def compare_transformers(args, runs: list[dict], baseline: dict, requests) -> dict[str, Any]:
    from asyncpp.bench.hf_compare import compare

    model = baseline["config"]["model"]
    num_threads = args.compare_threads or baseline["num_cores"]
    batch_sizes = [len(requests) if b.strip() == "all" else int(b) for b in args.compare_batch_sizes.split(",")]
    results = compare(
        requests, sorted(set(batch_sizes)), source=model.get("source", "gguf"), path=model.get("path") or None,
        dtype=baseline["dtype"], num_threads=num_threads, ignore_eos=args.ignore_eos,
        device=model.get("device", "cpu"),
    )
    by_size = [r.to_dict() for r in results]
    best = max(by_size, key=lambda r: r["output_throughput"])
    reference = f"transformers bs={best['batch_size']}"
    ratios = [row for run in runs for row in ratio_rows(run["label"], run["metrics"], reference, best) if row["metric"] in HF_KEYS]
    return {"batch_sizes": by_size, "best": best, "ratios": ratios}


def pick_baseline(specs: list[RunSpec], key: str) -> int:
    """Index of the run every other is compared with: a 1-based index or a label."""
    if key.isdigit() and 1 <= int(key) <= len(specs):
        return int(key) - 1
    for i, spec in enumerate(specs):
        if spec.label == key:
            return i
    raise ValueError(f"--baseline {key!r} names no run (runs: {[s.label for s in specs]})")


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_model": cpu_info().model_name,
        "best_isa": cpu_info().best_level,
        "asyncpp_version": asyncpp.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def repetition_ratios(repetition: list[dict], base: int) -> list[dict]:
    """Ratio rows of one repetition: each of its other runs against its baseline run (run / baseline)."""
    baseline = repetition[base]
    rows = []
    for run in repetition:
        if run is baseline:
            continue
        for row in ratio_rows(run["label"], run["metrics"], baseline["label"], baseline["metrics"]):
            rows.append(row | {"repeat": run["repeat"], "subject_variant": run["variant"],
                               "reference_variant": baseline["variant"]})
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_external(args: argparse.Namespace, requests, warmup) -> dict[str, Any]:
    """One run against a server we did not launch: client-side metrics only."""
    backend = OpenAIBackend(args.base_url, args.model, args.api_key)
    load = uvloop.run(
        run_load(
            "", requests, warmup, backend=backend,
            max_concurrency=args.max_concurrency, request_rate=args.request_rate, seed=args.seed,
            ignore_eos=args.ignore_eos, temperature=args.temperature,
            burst_size=args.burst_size, burst_gap_s=args.burst_gap_s,
        )
    )  # fmt: skip
    metrics = serving_metrics(load.records, load.duration_s)
    return {"label": args.base_url, "backend": "openai", "model": backend.model, "metrics": metrics,
            "requests": [r.to_dict() for r in load.records]}  # fmt: skip


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.base_url:
        requests, warmup = make_requests(args)
        run = bench_external(args, requests, warmup)
        print(report.external_block(run), flush=True)
        return {"args": _plain(vars(args)), "machine": machine_info(), "num_requests": len(requests), "runs": [run],
                "external": True}  # fmt: skip
    specs = parse_runs(args.runs)
    base = pick_baseline(specs, args.baseline)  # before any engine starts: a bad --baseline costs nothing
    requests, warmup = make_requests(args)
    result: dict[str, Any] = {"args": _plain(vars(args)), "machine": machine_info(), "num_requests": len(requests)}
    repetitions: list[list[dict]] = []
    with tempfile.TemporaryDirectory(prefix="asyncpp-bench-") as tmp:
        for rep in range(1, args.repeat + 1):
            repetition = []
            for i, spec in enumerate(specs):
                labelled = RunSpec(f"{spec.label} #{rep}", spec.overrides) if args.repeat > 1 else spec
                run = bench_run(labelled, args, requests, warmup, Path(tmp) / f"run{rep}-{i}.toml")
                run |= {"variant": spec.label, "repeat": rep}
                print(report.run_block(run), flush=True)
                repetition.append(run)
            repetitions.append(repetition)
    runs = [run for repetition in repetitions for run in repetition]
    result |= {"runs": runs, "baseline": specs[base].label}
    result["ratios"] = [row for repetition in repetitions for row in repetition_ratios(repetition, base)]
    if args.repeat > 1:
        result["ratio_summary"] = summarize_ratios(result["ratios"])
    if args.compare == "transformers":
        result["transformers"] = compare_transformers(args, runs, repetitions[0][base], requests)
        result["ratios"] += result["transformers"]["ratios"]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    restore = _sigterm_as_interrupt()
    try:
        result = run_benchmark(args)
    except KeyboardInterrupt:
        print("interrupted: engines stopped", file=sys.stderr)
        return 130
    except (EngineStartError, RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        restore()
    if not result.get("external"):
        print(report.summary_table(result))
        print(report.ratio_lines(result), flush=True)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
        print(f"results written to {args.result_json}")
    failed = sum(r["metrics"]["failed"] for r in result["runs"])
    return 1 if failed else 0


def _sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C, so the engines' `finally` blocks stop them; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _slug(label: str) -> str:
    return re.sub(r"[^\w.-]+", "_", label)


def _plain(args: dict[str, Any]) -> dict[str, Any]:
    """Arguments as strict JSON allows them (no Infinity)."""
    return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in args.items()}
