"""`python -m asyncpp.bench.pd_serve`: disaggregated serving against one colocated engine.

A prefill-heavy workload (random prompts of `--input-len` tokens, `--output-len`
output tokens, Poisson arrivals at `--request-rate`) is served, in interleaved
repetitions, by (a) one engine launched from `--colocated` (default: the
default config, pp=2) and (b) the prefill/decode deployment launched from
`--disagg` (default: configs/pd-1-1.toml, one stage each), once per
`--handovers` mode (`disagg.handover`: "early", the decode engine gets each
request with the prefill engine; "after_prefill", once the prefill is done),
on the same cores (with `--pulls`, once per `kv_transfer.options.pull` value too,
each also read against the first). Per run: TTFT, TPOT and ITL mean / p99 and output tok/s as the client
sees them; for (b) also the handover (the decode engine's stats: from the
prefill engine's first token to the decode stages holding the prompt's KV,
that is the start of the request's first decode step) and the client's gap
between its first two tokens (the router's clock: the handover, then one
decode step). Then the raw transfer of the bytes one request hands over
(every layer's K and V of every prompt block), moved by one NIXL read and by
a memcpy in this process (`bench.pd_transfer`), so the handover can be read
against both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import uvloop

from asyncpp.bench.datasets import random_requests
from asyncpp.bench.engine_proc import launched_engine
from asyncpp.bench.load import run_load
from asyncpp.bench.metrics import serving_metrics
from asyncpp.bench.runs import RunSpec, _toml_value, run_sections, to_toml
from asyncpp.disagg.config import load_disagg_config
from asyncpp.weights import read_arch

_FIGURES = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "output_throughput")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.pd_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--colocated", default="configs/default.toml")
    ap.add_argument("--disagg", default="configs/pd-1-1.toml")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--handovers", default="early,after_prefill", help="disagg.handover modes to run, comma-separated")
    ap.add_argument(
        "--pulls", default="", help="kv_transfer.options.pull values to run each handover mode with, comma-separated "
        "(empty: the config's)",
    )  # fmt: skip
    ap.add_argument("--repeat", type=int, default=2, help="interleaved repetitions (A B A B ...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json", help="write every figure here")
    return ap.parse_args(argv)


def serve(config_path: Path, args, requests, warmup) -> dict[str, Any]:
    with launched_engine(config_path) as engine:
        load = uvloop.run(
            run_load(
                engine.address, requests, warmup, max_concurrency=None, request_rate=args.request_rate,
                seed=args.seed, ignore_eos=True,
            )
        )  # fmt: skip
    metrics = serving_metrics(load.records, load.duration_s)
    return {"metrics": metrics, "stats": load.stats_after}


def handed_over_shape(config_path: str, input_len: int) -> dict[str, int]:
    """The blocks one prompt of `input_len` tokens hands over, in `bench.pd_transfer`'s terms."""
    config = load_disagg_config(config_path).engine_config("decode")
    arch = read_arch(config.model.source, config.model.path_or_none)
    block_size = config.cache.block_size
    return {
        "num_blocks": -(-input_len // block_size),
        "block_size": block_size,
        "layers": arch.num_layers,
        "heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, seed=args.seed)
    warmup = random_requests(2, args.input_len, args.output_len, seed=args.seed + 1000)
    work = Path(tempfile.mkdtemp(prefix="asyncpp-pd-bench-"))
    colocated = work / "colocated.toml"
    colocated.write_text(to_toml(run_sections(args.colocated, RunSpec("colocated", ()))))
    configs = {"colocated": colocated}
    for mode in args.handovers.split(","):
        for pull in args.pulls.split(","):
            sections = tomllib.loads(Path(args.disagg).read_text())
            sections.setdefault("server", {})["port"] = 0
            sections.setdefault("disagg", {})["handover"] = mode
            name = f"disagg:{mode}" + (f":{pull}" if pull else "")
            if pull:
                sections.setdefault("kv_transfer", {}).setdefault("options", {})["pull"] = pull
            configs[name] = work / f"{name.replace(':', '-')}.toml"
            configs[name].write_text(_disagg_toml(sections))
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.repeat):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            result = serve(configs[name], args, requests, warmup)
            runs[name].append(result)
            m = result["metrics"]
            print(
                f"rep {r} {name:20s} TTFT mean/p99 {m['mean_ttft_ms']:7.1f}/{m['p99_ttft_ms']:7.1f} ms  "
                f"TPOT mean/p99 {m['mean_tpot_ms']:6.1f}/{m['p99_tpot_ms']:6.1f} ms  "
                f"{m['output_throughput']:6.1f} tok/s  failed {m['failed']}",
                flush=True,
            )
    summary: dict[str, Any] = {"args": vars(args), "runs": {k: [x["metrics"] for x in v] for k, v in runs.items()}}
    from asyncpp.bench.pd_transfer import measure

    raw = measure(**handed_over_shape(args.disagg, args.input_len), placement="runs", repeat=11)
    nbytes = raw["nbytes"]
    nixl_s, memcpy_s = nbytes / (raw["nixl_gbps"] * 1e9), nbytes / (raw["memcpy_gbps"] * 1e9)
    summary |= {"raw": raw, "nbytes": nbytes}
    print(f"\nraw NIXL read of the {nbytes / 1e6:.1f} MB one request hands over {nixl_s * 1e3:.2f} ms, memcpy {memcpy_s * 1e3:.2f} ms")
    for name in configs:
        if name != "colocated":
            summary[name] = _disagg_summary(name, runs["colocated"], runs[name], nixl_s)
    pulls = args.pulls.split(",")
    for mode in args.handovers.split(",") if len(pulls) > 1 else []:
        base = f"disagg:{mode}:{pulls[0]}"
        for pull in pulls[1:]:
            summary[f"disagg:{mode}:{pull}/{pulls[0]}"] = _pull_ratios(f"disagg:{mode}:{pull}", base, runs)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summary, indent=2, default=str))
    return 0


def _disagg_summary(name: str, colocated: list[dict], disagg: list[dict], nixl_s: float) -> dict[str, Any]:
    print(f"\n{name} / colocated (median over repetitions, min - max):")
    ratios = {}
    for figure in _FIGURES:
        values = [d["metrics"][figure] / c["metrics"][figure] for c, d in zip(colocated, disagg)]
        ratios[figure] = values
        print(f"  {figure:18s} {statistics.median(values):.2f}x ({min(values):.2f} - {max(values):.2f})")
    figures = {key: [d["stats"].get(key) for d in disagg] for key in
               ("kv_handover_s_mean", "kv_handover_s_p50", "kv_handover_s_p99", "pd_second_token_s_p50")}  # fmt: skip
    print("  handover (prefill's first token -> the decode's first step with its KV in place):")
    print(f"    mean {_ms(figures['kv_handover_s_mean'])}  p50 {_ms(figures['kv_handover_s_p50'])}  "
          f"p99 {_ms(figures['kv_handover_s_p99'])} ms")  # fmt: skip
    print(f"    first -> second token at the client (router): p50 {_ms(figures['pd_second_token_s_p50'])} ms")
    valid = [h for h in figures["kv_handover_s_p50"] if h is not None]
    if valid:
        print(f"    handover p50 / raw NIXL = {statistics.median(valid) / nixl_s:.2f}x")
    return {"ratios": ratios, **figures}


def _pull_ratios(name: str, base: str, runs: dict[str, list[dict]]) -> dict[str, list[float]]:
    """One pull mode against another, per repetition (each pair measured in the same repetition)."""
    print(f"\n{name} / {base} (median over repetitions, min - max):")
    ratios = {}
    pairs = list(zip(runs[base], runs[name]))
    getters = {f: (lambda r, f=f: r["metrics"][f]) for f in _FIGURES}
    getters |= {k: (lambda r, k=k: r["stats"].get(k)) for k in ("kv_handover_s_p50", "pd_second_token_s_p50")}
    for figure, get in getters.items():
        values = [get(n) / get(b) for b, n in pairs if get(b) and get(n) is not None]
        ratios[figure] = values
        if values:
            print(f"  {figure:22s} {statistics.median(values):.2f}x ({min(values):.2f} - {max(values):.2f})")
    return ratios


def _ms(values) -> str:
    return ", ".join("-" if v is None else f"{v * 1e3:.1f}" for v in values)


def _disagg_toml(sections: dict[str, Any]) -> str:
    """The PD config back as TOML; `[disagg.prefill]` / `[disagg.decode]` hold quoted dotted keys."""
    disagg = sections.pop("disagg", {})
    tables = {name: v for name, v in disagg.items() if isinstance(v, dict)}
    text = to_toml({**sections, "disagg": {k: v for k, v in disagg.items() if k not in tables}})
    for name, table in tables.items():
        text += f"[disagg.{name}]\n" + "".join(f"{_toml_value(k)} = {_toml_value(v)}\n" for k, v in table.items()) + "\n"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
