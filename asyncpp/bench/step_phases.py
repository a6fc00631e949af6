"""`python -m asyncpp.bench.step_phases`: where each process spends a step, phase by phase, under load.

For each run (`--runs`, as in `asyncpp.bench`) and each `--concurrency`, an
engine is launched from `--config` with `ASYNCPP_STEP_PHASES=1`
(`asyncpp.step_phases`), serves `--num-prompts` random prompts of
`--input-len` words with `--output-len` tokens each, and is stopped; every
process then logs its `step_phases` event. Printed per process (the engine,
each stage): each phase's milliseconds per step, host time and, on CUDA, the
GPU time the stage bracketed with events (the forward, the sampling), with
the mean TPOT the client saw next to them. A stage's phases add up to its
whole step, idle time included (`wait_plan`, `wait_activations`,
`wait_tokens`); the engine's are the calls it times (scheduling, sending
plans, applying outputs, delivering deltas). The first run of a GPU
profile (`scripts/gpu_check.sh`) is what asyncpp's host-bound GPU path
needs measured; on CPU it shows the same split.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import uvloop

from asyncpp.bench.datasets import random_requests
from asyncpp.bench.engine_proc import launched_engine
from asyncpp.bench.load import run_load
from asyncpp.bench.metrics import serving_metrics
from asyncpp.bench.runs import parse_runs, run_sections, to_toml
from asyncpp.step_phases import ENV_VAR


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.step_phases", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--runs", default="", help='"pp=1;pp=2": one profile per run (default: the config as it is)')
    ap.add_argument("--concurrency", default="16", help="comma-separated, one profile each")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json", help="write every profile here")
    return ap.parse_args(argv)


def profile(config_path: Path, log_path: Path, concurrency: int, args) -> dict[str, Any]:
    """Serve the load once with step phases on; the client's figures and every process's phases."""
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, seed=args.seed)
    warmup = random_requests(2, args.input_len, args.output_len, seed=args.seed + 1000)
    extra = ["--log-format", "json", "--log-file", str(log_path)]
    with launched_engine(config_path, log_level="info", extra_args=extra, env={ENV_VAR: "1"}) as engine:
        load = uvloop.run(
            run_load(engine.address, requests, warmup, max_concurrency=concurrency, request_rate=float("inf"),
                     seed=args.seed, ignore_eos=True)
        )  # fmt: skip
    return {"metrics": serving_metrics(load.records, load.duration_s), "processes": read_phases(log_path)}


def read_phases(log_path: Path) -> dict[str, dict[str, Any]]:
    """Every `step_phases` event of a JSON log, by process: "engine", "stage0", "stage1", ..."""
    found = {}
    for line in log_path.read_text().splitlines():
        if '"step_phases"' not in line:
            continue
        event = json.loads(line)
        if event.get("event") != "step_phases":
            continue
        name = "engine" if event.get("role") == "engine" else f"stage{event.get('pp_rank')}"
        found[name] = {"num_steps": event["num_steps"], "phases": event["phases"]}
    return found


def format_profile(label: str, result: dict[str, Any]) -> str:
    m = result["metrics"]
    lines = [
        f"{label}: mean TPOT {m['mean_tpot_ms']:.2f} ms, {m['output_throughput']:.1f} output tok/s, "
        f"{m['failed']} failed"
    ]
    for process, data in sorted(result["processes"].items()):
        phases = data["phases"]
        total = sum(p.get("host_ms", 0.0) for p in phases.values())
        lines.append(f"  {process} ({data['num_steps']} steps, {total:.3f} host ms per step in these phases)")
        for name, p in sorted(phases.items(), key=lambda kv: -kv[1].get("host_ms", 0.0)):
            gpu = f"  gpu {p['gpu_ms']:8.3f}" if "gpu_ms" in p else ""
            share = p.get("host_ms", 0.0) / total * 100 if total else 0.0
            lines.append(f"    {name:18s} host {p.get('host_ms', 0.0):8.3f} ms/step {share:5.1f}%{gpu}  ({p['calls']} calls)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="asyncpp-phases-"))
    results = {}
    for i, run in enumerate(parse_runs(args.runs)):
        config_path = work / f"run{i}.toml"
        config_path.write_text(to_toml(run_sections(args.config, run)))
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            label = f"{run.label} c={concurrency}"
            log_path = work / f"run{i}-c{concurrency}.jsonl"
            results[label] = profile(config_path, log_path, concurrency, args)
            print(format_profile(label, results[label]), flush=True)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2))
    print(f"logs in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
