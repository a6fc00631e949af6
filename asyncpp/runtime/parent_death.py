"""A child that dies with its parent: Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`).

A launcher killed outright (SIGKILL, the OOM killer) reaps nothing; without
this its children live on as orphans: stages block on sockets whose peer is
gone, the HTTP server keeps its port, an engine child keeps serving. The
kernel sends the signal when the thread that forked the child exits, so the
launcher forks from its main thread (its event loop's). If the parent died
before the signal was set, nobody would send it: the child then checks its
parent is still the one that started it and exits at once if not. Elsewhere
than Linux this does nothing; the launcher's own reaping is all there is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: signal.Signals, parent_pid: int | None) -> None:
    """In a child just started by `parent_pid`: get `sig` when that parent dies; exit now if it is gone
    (None: a parent not known, not checked)."""
    libc = _libc()
    if libc is not None:
        _set(libc, sig, parent_pid)


def preexec_dying_with_parent(sig: signal.Signals, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A `preexec_fn` for a subprocess of this process that dies with it (then runs `then`).

    libc is loaded here, in the parent: between fork and exec the child makes system calls only."""
    libc = _libc()
    parent_pid = os.getpid()

    def in_child() -> None:
        if libc is not None:
            _set(libc, sig, parent_pid)
        if then is not None:
            then()

    return in_child


def _set(libc: ctypes.CDLL, sig: signal.Signals, parent_pid: int | None) -> None:
    libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
