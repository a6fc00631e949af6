"""Text output of the serving benchmark: one block per run, a summary table, the ratios.

Everything printed comes from the result dict that is also written as JSON,
so the two never disagree.
"""

from __future__ import annotations

from typing import Any

from asyncpp.bench.compute_report import compute_cell, compute_lines, weight_mb
from asyncpp.bench.kv_report import kv_hits, kv_lines, kv_rates
from asyncpp.bench.spec_report import spec_cell, spec_lines

WIDTH = 60


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def triple(m: dict[str, Any], name: str, digits: int = 1) -> str:
    return " / ".join(fmt(m.get(f"{k}_{name}_ms"), digits) for k in ("mean", "p50", "p99"))


def external_block(run: dict[str, Any]) -> str:
    """A server we did not launch (`--base-url`): the client-side serving metrics only."""
    lines = [f" Serving benchmark: {run['label']} (model {run['model']}) ".center(WIDTH, "=")]
    _metric_lines(lines, run["metrics"])
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _metric_lines(lines: list[str], m: dict[str, Any]) -> None:
    def row(name: str, value: Any) -> None:
        lines.append(f"{name:<40}{value:>20}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", fmt(m["duration_s"]))
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", fmt(m["request_throughput"]))
    row("Output token throughput (tok/s):", fmt(m["output_throughput"]))
    row("Total token throughput (tok/s):", fmt(m["total_token_throughput"]))
    for title, name in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                        ("Inter-token Latency", "itl"), ("End-to-end Latency", "e2el")):
        lines.append(f" {title} ".center(WIDTH, "-"))
        for key in ("mean", "p50", "p99"):
            row(f"{key.capitalize() if key == 'mean' else key.upper()} {name.upper()} (ms):", fmt(m[f"{key}_{name}_ms"]))
        for kind in ("cold", "warm") if name == "ttft" else ():  # only with the shared-prefix workload
            if f"ttft_{kind}_ms" in m:
                split = m[f"ttft_{kind}_ms"]
                row(f"P50 / P99 TTFT {kind}, {split['count']} req (ms):", _p50_p99(split))


def run_block(run: dict[str, Any]) -> str:
    m, st = run["metrics"], run["stages"]
    cores = f"{run['num_cores']} core" + ("s" if run["num_cores"] != 1 else "")
    via = f", via {run['backend']}" if run.get("backend", "native") != "native" else ""
    lines = [f" Serving benchmark: {run['label']} ({cores}{via}) ".center(WIDTH, "=")]

    def row(name: str, value: Any) -> None:
        lines.append(f"{name:<40}{value:>20}")

    _metric_lines(lines, m)
    if run.get("spec_decode"):  # right under output tok/s and TPOT, which drafting is meant to move
        lines.append(" Speculative decoding (measured window) ".center(WIDTH, "-"))
        lines += spec_lines(run["spec_decode"])
    if run.get("compute"):
        lines.append(" Compute ".center(WIDTH, "-"))
        lines += compute_lines(run["compute"])
    lines.append(" Pipeline stages (measured window) ".center(WIDTH, "-"))
    for rank, busy in enumerate(st["busy_fraction"]):
        row(f"Stage {rank} busy fraction:", fmt(busy, 3))
    row("Engine steps:", st["num_steps"])
    for rank, (p50, p99) in enumerate(zip(st["handoff_us_p50"], st["handoff_us_p99"])):
        row(f"Hand-off {rank}->{rank + 1} p50 / p99 (us):", f"{fmt(p50, 1)} / {fmt(p99, 1)}")
    lines.append(" CPU time (measured window) ".center(WIDTH, "-"))
    cpu = run["cpu"]
    processes = [("Engine", cpu["engine"]), ("Client", cpu["client"])]
    processes += [(f"Stage {rank}", figures) for rank, figures in enumerate(cpu["stages"])]
    processes += [("Machine busy", cpu["machine_busy"]), ("Machine stolen", cpu["machine_stolen"])]
    for name, figures in processes:
        row(f"{name} CPU %core / us/out tok:", _cpu(figures))
    for kind, mc in run["memcpy"].items():
        label = f"memcpy {kind} {mc['num_tokens']} tok {mc['nbytes'] / 1024:.0f} KiB p50/p99 (us):"
        row(label, f"{fmt(mc['p50_us'], 1)} / {fmt(mc['p99_us'], 1)}")
    if run.get("kv_transfer"):
        lines.append(" KV connector (measured window) ".center(WIDTH, "-"))
        lines += kv_lines(run["kv_transfer"])
    if grammar := run.get("structured"):
        lines.append(" Structured outputs (JSON schema) ".center(WIDTH, "-"))
        row("Grammar compile, first / cached (ms):", f"{fmt(grammar['compile_first_s'] * 1e3, 3)} / {fmt(grammar['compile_cached_s'] * 1e3, 3)}")
        row("Grammar tokenizer build (ms):", fmt(grammar["tokenizer_s"] * 1e3, 1))
        row("Engine compiles / cache hits:", f"{grammar['engine_num_compiled']} / {grammar['engine_num_cache_hits']}")
    if rec := run.get("recovery"):
        lines.append(" Stage killed mid-run ".center(WIDTH, "-"))
        row("Kill -> next token (s):", fmt(rec["kill_to_next_token_s"]))
        row("Stage start, first / restarts (s):", " / ".join(fmt(s) for s in rec["stage_start_s"]))
        row("Restarts / failed requests:", f"{rec['num_restarts']} / {rec['num_failed_requests']}")
        row("Recomputed requests / tokens:", f"{rec['num_recomputed_requests']} / {rec['num_recomputed_tokens']}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def summary_table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    hf = result.get("transformers")
    headers = ["metric"] + [r["label"] for r in runs] + ([f"transformers bs={hf['best']['batch_size']}"] if hf else [])
    rows: list[list[str]] = []

    def add(name: str, cells: list[str], hf_cell: str = "") -> None:
        rows.append([name, *cells] + ([hf_cell] if hf else []))

    ms = [r["metrics"] for r in runs]
    best = hf["best"] if hf else {}
    add("cores (torch threads)", [str(r["num_cores"]) for r in runs], str(best.get("num_threads", "")))
    if any(r.get("compute") for r in runs):
        add("isa / dtype / weights", [compute_cell(r.get("compute")) for r in runs], "-")
        add("weights MB per stage", [weight_mb(r.get("compute")) for r in runs], "-")
    add("req/s", [fmt(m["request_throughput"]) for m in ms], fmt(best.get("request_throughput")))
    add("output tok/s", [fmt(m["output_throughput"], 1) for m in ms], fmt(best.get("output_throughput"), 1))
    add("duration s", [fmt(m["duration_s"]) for m in ms], fmt(best.get("duration_s")))
    for name in ("ttft", "tpot", "itl"):
        add(f"{name.upper()} mean/p50/p99 ms", [triple(m, name) for m in ms], "-")
    if any(r.get("spec_decode") for r in runs):
        add("spec accept % / tok per draft", [spec_cell(r.get("spec_decode")) for r in runs], "-")
    for kind in ("cold", "warm"):
        if any(f"ttft_{kind}_ms" in m for m in ms):
            add(f"TTFT {kind} prefix p50/p99 ms", [_p50_p99(m.get(f"ttft_{kind}_ms")) for m in ms], "-")
    if any(r.get("kv_transfer") for r in runs):
        add("KV load/save GB/s (memcpy)", [kv_rates(r.get("kv_transfer")) for r in runs], "-")
        add("KV prefix hit tok ext/local", [kv_hits(r.get("kv_transfer")) for r in runs], "-")
    add("stage busy fraction", ["/".join(fmt(b) for b in r["stages"]["busy_fraction"]) for r in runs], "-")
    add("hand-off p50/p99 us", [_handoff(r) for r in runs], "-")
    add("engine CPU %core / us/tok", [_cpu(r["cpu"]["engine"]) for r in runs], "-")
    add("client CPU %core / us/tok", [_cpu(r["cpu"]["client"]) for r in runs], "-")
    add("memcpy decode/prefill us", [_memcpy(r) for r in runs], "-")
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    out = [" Summary ".center(sum(widths) + 2 * len(widths), "=")]
    for row in [headers, *rows]:
        out.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    if hf:
        sizes = ", ".join(f"bs={r['batch_size']} {fmt(r['output_throughput'], 1)}" for r in hf["batch_sizes"])
        out.append(f"transformers output tok/s by static batch size: {sizes}")
    return "\n".join(out)


def ratio_lines(result: dict[str, Any]) -> str:
    out = [f" Ratios (baseline: {result['baseline']}) ".center(WIDTH, "=")]
    if not result["ratios"]:
        out.append("(one run and no --compare: nothing to compare)")
    for r in result["ratios"]:
        better = "higher is better" if r["higher_is_better"] else "lower is better"
        out.append(f"{r['subject']} {r['name']} = {fmt(r['ratio'])}x {r['reference']}  ({better})")
    if result.get("ratio_summary"):
        out.append(f" Over {result['args']['repeat']} repetitions: median (min - max) ".center(WIDTH, "-"))
        for r in result["ratio_summary"]:
            spread = f"{fmt(r['median'])}x ({fmt(r['min'])} - {fmt(r['max'])})"
            out.append(f"{r['subject']} {r['name']} = {spread} {r['reference']}")
    return "\n".join(out)


def _handoff(run: dict[str, Any]) -> str:
    st = run["stages"]
    if not st["handoff_us_p50"]:
        return "-"
    return ", ".join(f"{fmt(a, 0)}/{fmt(b, 0)}" for a, b in zip(st["handoff_us_p50"], st["handoff_us_p99"]))


def _cpu(figures: dict[str, Any]) -> str:
    return f"{fmt(figures['core_pct'], 1)} / {fmt(figures['cpu_us_per_output_token'], 0)}"


def _p50_p99(split: dict[str, Any] | None) -> str:
    return "-" if not split else f"{fmt(split['p50'], 1)} / {fmt(split['p99'], 1)}"


def _memcpy(run: dict[str, Any]) -> str:
    mc = run["memcpy"]
    return f"{fmt(mc['decode']['p50_us'], 1)}/{fmt(mc['prefill']['p50_us'], 1)}"
