"""`asyncpp`, the console script: `asyncpp serve` (the OpenAI server), `asyncpp bench` and `asyncpp trace`.

`bench` and `trace` take the arguments of `python -m asyncpp.bench` and
`python -m asyncpp.trace`; `python -m asyncpp.launch --config FILE` works as
before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: asyncpp {serve,bench,trace} ...

  serve [MODEL] [flags]   the OpenAI-compatible server (vLLM's flags; asyncpp serve --help)
  bench [args]            the serving benchmark (python -m asyncpp.bench; asyncpp bench --help)
  trace LOGFILE [args]    a log as a Chrome trace and a figure (python -m asyncpp.trace)"""


def _serve(argv: list[str]) -> int:
    from asyncpp.cli.serve import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from asyncpp.bench.serve import main

    return main(argv)


def _trace(argv: list[str]) -> int:
    from asyncpp.trace.__main__ import main

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {"serve": _serve, "bench": _bench, "trace": _trace}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"asyncpp: error: unknown command {args[0]!r} (choose from serve, bench, trace)", file=sys.stderr)
        return 2
    return command(args[1:])
