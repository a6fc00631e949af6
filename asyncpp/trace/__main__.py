"""CLI: turn an asyncpp JSON-lines log into a Chrome trace, a text summary and optionally a PNG.

    python -m asyncpp.trace LOGFILE -o trace.json [--png summary.png]

Open trace.json in ui.perfetto.dev or chrome://tracing. Exit status 0 when
the trace was written (also for a log without stage slices, which is
reported), 2 when the log cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from asyncpp.trace.chrome import build_trace
from asyncpp.trace.parse import parse_log
from asyncpp.trace.stats import format_summary, pipeline_stats


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.trace", description=__doc__.splitlines()[0])
    ap.add_argument("logfile", help="JSON-lines log written with --log-file (stage slices need --log-level debug)")
    ap.add_argument("-o", "--output", default="trace.json", help="Chrome trace JSON to write (default: trace.json)")
    ap.add_argument("--png", help="also write a summary figure (needs matplotlib)")
    ns = ap.parse_args(argv)

    try:
        log = parse_log(ns.logfile)
    except OSError as e:
        print(f"cannot read {ns.logfile}: {e}", file=sys.stderr)
        return 2
    stats = pipeline_stats(log)
    with open(ns.output, "w") as f:
        json.dump(build_trace(log, stats, source=ns.logfile), f)
    print(format_summary(log, stats))
    print(f"trace written to {ns.output}")
    if ns.png:
        from asyncpp.trace.plot import render_summary_png

        render_summary_png(log, stats, ns.png)
        print(f"summary figure written to {ns.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
