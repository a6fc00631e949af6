"""Faults a test injects into stage processes through their environment; nothing sets them otherwise.

`ASYNCPP_FAULT_STAGE_EXIT="RANK:N"`: stage RANK exits (code 3) as it starts,
from its N-th restart on (`StageGroup.start_again` counts them in
`ASYNCPP_STAGE_INCARNATION`), so a test can make a stage that dies at every
restart: a crash loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

INCARNATION_ENV = "ASYNCPP_STAGE_INCARNATION"  # 0 for the first processes, n after n restarts
FAULT_EXIT_ENV = "ASYNCPP_FAULT_STAGE_EXIT"
FAULT_EXIT_CODE = 3


def is_faulted(pp_rank: int, environ: Mapping[str, str]) -> bool:
    """Whether `FAULT_EXIT_ENV` in `environ` names stage `pp_rank` in its incarnation."""
    spec = environ.get(FAULT_EXIT_ENV)
    if not spec:
        return False
    rank, _, first = spec.partition(":")
    return int(rank) == pp_rank and int(environ.get(INCARNATION_ENV, "0")) >= int(first or "0")


def exit_if_faulted(pp_rank: int, environ: Mapping[str, str] = os.environ) -> None:
    """Exit at once when `FAULT_EXIT_ENV` names this stage and its incarnation."""
    if is_faulted(pp_rank, environ):
        os._exit(FAULT_EXIT_CODE)
