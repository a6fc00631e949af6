"""`python -m asyncpp.bench.dp_probe_table OUT_DIR`: the tables of a `scripts/dp_probe.sh` run.

The probe leaves one `load.py` JSON per server, workload and round in OUT_DIR,
named as a sitting names them (`asyncpp.bench.peers_table.read_runs`):
"vllm", "pp2" (the default deployment) and the two halves of each split
data-parallel run, "dp2a" and "dp2b" (c1 runs on "dp2a" alone). A split run
counts as one ("dp2"): both halves' tokens over the longer half's duration,
mean TTFT and TPOT over all their requests, the larger half's p99 TTFT (so
never flattered); a round with one half missing is left out. Printed, and
kept in OUT_DIR/table.md: each server's figures per round and workload, then
dp2 and pp2 against each other and against vLLM, every ratio taken within a
round (median [range], then the rounds).
"""

from __future__ import annotations

import sys
from pathlib import Path

from asyncpp.bench.peers_table import OUTPUT, P99, TPOT, TTFT, Rounds, per_round, read_runs, spread

SERVERS = ("vllm", "pp2", "dp2")
WORKLOADS: tuple[int | str, ...] = (1, 16, 64, "long")


def merged(halves: list[dict]) -> dict:
    """One run from the halves of a split one (see the module's docstring)."""
    num_requests = sum(h["completed"] for h in halves)
    return {
        OUTPUT: sum(h[OUTPUT] * h["duration_s"] for h in halves) / max(h["duration_s"] for h in halves),
        TPOT: sum(h[TPOT] * h["completed"] for h in halves) / num_requests,
        TTFT: sum(h[TTFT] * h["completed"] for h in halves) / num_requests,
        P99: max(h[P99] for h in halves),
    }


def dp_runs(out: Path, workload: int | str) -> Rounds:
    """The data-parallel runs of one workload, each split run merged from its two halves."""
    first = read_runs(out, "dp2a", workload)
    if workload == 1:  # one request at a time goes to the first engine alone
        return {r: merged([d]) for r, d in first.items()}
    second = read_runs(out, "dp2b", workload)
    return {r: merged([d, second[r]]) for r, d in first.items() if r in second}


def tables(out: Path) -> str:
    runs = {(s, w): dp_runs(out, w) if s == "dp2" else read_runs(out, s, w) for s in SERVERS for w in WORKLOADS}
    rows = [
        "| server | workload | per round: output tok/s (mean TPOT ms); long: mean / p99 TTFT ms |",
        "| --- | --- | --- |",
    ]
    for server in SERVERS:
        for w in WORKLOADS:
            got = runs[server, w].values()
            if got:
                cells = [f"{d[TTFT]:.0f} / {d[P99]:.0f}" if w == "long" else f"{d[OUTPUT]:.1f} ({d[TPOT]:.2f})" for d in got]
                rows.append(f"| {server} | {w if w == 'long' else f'c{w}'} | {', '.join(cells)} |")
    ratios = []
    for w in (16, 64):
        for num, den in (("dp2", "pp2"), ("dp2", "vllm"), ("pp2", "vllm")):
            ratios.append((f"c{w} output, {num} / {den}", per_round(runs[num, w], [runs[den, w]], OUTPUT, max)))
    ratios.append(("c1 TPOT, dp2 / pp2", per_round(runs["dp2", 1], [runs["pp2", 1]], TPOT, max)))
    for metric, name in ((TTFT, "mean"), (P99, "p99")):
        for num in ("dp2", "pp2"):
            ratios.append((f"long {name} TTFT, {num} / vllm", per_round(runs[num, "long"], [runs["vllm", "long"]], metric, max)))
    rows += ["", "| ratio | median [range] | rounds |", "| --- | ---: | --- |"]
    rows += [f"| {label} | {spread(xs)} | {', '.join(f'{x:.2f}x' for x in xs)} |" for label, xs in ratios if xs]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m asyncpp.bench.dp_probe_table OUT_DIR (a directory)", file=sys.stderr)
        return 2
    out = Path(args[0])
    text = tables(out)
    print(text, end="")
    (out / "table.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
