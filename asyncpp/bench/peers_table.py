"""`python -m asyncpp.bench.peers_table OUT_DIR`: the tables of a `scripts/cpu_vs_peers.sh` sitting.

The sitting leaves one JSON per server, workload and round in OUT_DIR
(`NAME-cW.json` for round 1, `NAME-cW-rR.json` after it; W is a concurrency
or "long"), as `load.py` from the peers writes them. Printed, and kept in
OUT_DIR/table.md:

- output tok/s (mean TPOT) per server at c1, c16 and c64: the median of the
  rounds and their range;
- the long-prompt workload: mean and p99 TTFT and total tok/s per server;
- per round, each of issue #54's targets as a ratio: c1 TPOT over
  llama.cpp's, c16 and c64 output over the round's faster peer, long-prompt
  mean and p99 TTFT over the faster peer's (the lower); then each other
  deployment (one stage with two threads, one engine of two stages, the
  replicas without the long-prompt engine) over the default (item 4: which
  one wins, by workload) and over the faster peer.

A ratio is taken within a round, so that a slow spell of the shared machine
falls on both sides of it; a round missing either side is left out.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

SERVERS = ("llamacpp", "vllm-float32", "vllm-bfloat16", "asyncpp-auto", "asyncpp-avx2", "asyncpp-pp1", "asyncpp-pp2",
           "asyncpp-dp2")
PEERS = ("llamacpp", "vllm-float32", "vllm-bfloat16")
CONCURRENCIES = (1, 16, 64)
DEFAULT = "asyncpp-auto"
# The other deployments of the same model, each against the default (item 4: which one wins, by workload).
ALTERNATIVES = (("asyncpp-pp1", "one stage"), ("asyncpp-pp2", "one engine of two stages"),
                ("asyncpp-dp2", "the replicas alone"))

Rounds = dict[int, dict]  # round -> that round's load.py result
TPOT, OUTPUT, TTFT, P99 = "tpot_ms_mean", "output_tok_s", "ttft_ms_mean", "ttft_ms_p99"


def read_runs(out: Path, name: str, workload: int | str) -> Rounds:
    """Every round of one server and workload found in `out`."""
    files = {1: out / f"{name}-c{workload}.json"}
    for f in out.glob(f"{name}-c{workload}-r*.json"):
        files[int(f.stem.rsplit("-r", 1)[1])] = f
    return {r: json.loads(f.read_text()) for r, f in sorted(files.items()) if f.exists()}


def spread(values: list[float], fmt: str = "{:.2f}x") -> str:
    """'median [min-max]', or '-' for none."""
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def per_round(mine: Rounds, others: list[Rounds], metric: str, pick: Callable[..., float]) -> list[float]:
    """`mine[r][metric]` over `pick` (min or max) of the others' in round r, for every round both have."""
    ratios = []
    for r, d in sorted(mine.items()):
        theirs = [o[r][metric] for o in others if r in o]
        if theirs:
            ratios.append(d[metric] / pick(theirs))
    return ratios


def throughput_rows(results: dict[tuple[str, int], Rounds]) -> list[str]:
    rows = ["| server | c1 | c16 | c64 |", "| --- | ---: | ---: | ---: |"]
    for name in SERVERS:
        cells = []
        for c in CONCURRENCIES:
            got = list(results[name, c].values())
            if not got:
                cells.append("-")
                continue
            tok_s = [d[OUTPUT] for d in got]
            tpot = statistics.median(d[TPOT] for d in got)
            rng = f" [{min(tok_s):.1f}-{max(tok_s):.1f}]" if len(got) > 1 else ""
            cells.append(f"{statistics.median(tok_s):.1f} ({tpot:.1f}){rng}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def long_rows(long: dict[str, Rounds]) -> list[str]:
    rows = []
    for name in SERVERS:
        got = list(long[name].values())
        if got:
            mean = statistics.median(d[TTFT] for d in got)
            p99 = statistics.median(d[P99] for d in got)
            total = statistics.median(d.get("total_tok_s", 0.0) for d in got)
            rows.append(f"| {name} | {mean:.0f} | {p99:.0f} | {total:.0f} |")
    return ["| server | TTFT mean | TTFT p99 | total tok/s |", "| --- | ---: | ---: | ---: |", *rows] if rows else []


def target_rows(results: dict[tuple[str, int], Rounds], long: dict[str, Rounds]) -> list[str]:
    """Per target, the default's ratio per round (median [range]) and the rounds themselves."""
    peers = {c: [results[p, c] for p in PEERS] for c in CONCURRENCIES}
    long_peers = [long[p] for p in PEERS]
    mine = {c: results[DEFAULT, c] for c in CONCURRENCIES}
    targets = [
        ("c1: TPOT / llama.cpp's (target: at most 1)", per_round(mine[1], [results["llamacpp", 1]], TPOT, min)),
        ("c16: output / the faster peer's (target: 1.3)", per_round(mine[16], peers[16], OUTPUT, max)),
        ("c64: output / the faster peer's (target: 1.3)", per_round(mine[64], peers[64], OUTPUT, max)),
        ("long: mean TTFT / the faster peer's (target: at most 1)", per_round(long[DEFAULT], long_peers, TTFT, min)),
        ("long: p99 TTFT / the faster peer's (target: at most 1)", per_round(long[DEFAULT], long_peers, P99, min)),
    ]
    for name, label in ALTERNATIVES:
        other = {c: results[name, c] for c in CONCURRENCIES}
        targets += [
            (f"{label} / default: c1 TPOT", per_round(other[1], [mine[1]], TPOT, min)),
            (f"{label} / default: c16 output", per_round(other[16], [mine[16]], OUTPUT, max)),
            (f"{label} / default: c64 output", per_round(other[64], [mine[64]], OUTPUT, max)),
            (f"{label} / default: long mean TTFT", per_round(long[name], [long[DEFAULT]], TTFT, min)),
            (f"{label} / the faster peer: c16 output", per_round(other[16], peers[16], OUTPUT, max)),
            (f"{label} / the faster peer: c64 output", per_round(other[64], peers[64], OUTPUT, max)),
            (f"{label} / the faster peer: long mean TTFT", per_round(long[name], long_peers, TTFT, min)),
        ]
    rows = ["| per round | median [range] | rounds |", "| --- | ---: | --- |"]
    for label, ratios in targets:
        if ratios:
            rows.append(f"| {label} | {spread(ratios)} | {', '.join(f'{x:.2f}x' for x in ratios)} |")
    return rows if len(rows) > 2 else []


def tables(out: Path) -> str:
    results = {(name, c): read_runs(out, name, c) for name in SERVERS for c in CONCURRENCIES}
    long = {name: read_runs(out, name, "long") for name in SERVERS}
    parts = [
        "output tok/s (mean TPOT ms), 64 words in, 64 tokens out, ignore_eos; median [range] of the rounds:",
        *throughput_rows(results),
    ]
    if rows := long_rows(long):
        head = "long prompts (1000 words in, 16 out, concurrency 4): TTFT mean, p99 (ms), total tok/s; median of rounds:"
        parts += ["", head, *rows]
    if rows := target_rows(results, long):
        head = ("asyncpp's default against the targets; one stage with two threads, one engine of two stages, "
                "and the replicas alone, against it and the peers:")  # fmt: skip
        parts += ["", head, *rows]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m asyncpp.bench.peers_table OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    if not out.is_dir():
        print(f"{out} is not a directory", file=sys.stderr)
        return 2
    text = tables(out)
    print(text, end="")
    (out / "table.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
