"""Which CPUs each stage's threads are bound to (`parallel.pin_threads`).

A CPU stage computes on cores of its own, and a lone cohort's steps borrow the
other stages' cores (`parallel.lend_idle_threads`). Left to the scheduler, a
stage's lent OpenMP worker was often woken onto the core its own main thread
was running on: on 2 cores, one request, the two threads took turns on one
core every 30-100 µs while the other core idled (`perf sched timehist`), so a
step ran slower with its lent thread than without it. Binding thread i of
stage k to the i-th CPU of its list keeps them apart: the stage's own cores
first, then the next stages' cores in pipeline order (the cores a lent thread
borrows), then any CPU no stage owns. libgomp does the binding
(`GOMP_CPU_AFFINITY`): the main thread when the stage starts, each worker
when it is created.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

# OpenMP settings that already say where threads run: the user's choice wins over ours.
_USER_BINDING_ENV = ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")


def usable_cpu_ids() -> list[int]:
    """The CPUs this process (and the stages it spawns) may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def stage_cpu_lists(cpu_ids: Sequence[int], pp_size: int, num_threads: int) -> list[tuple[int, ...]] | None:
    """Per stage, the CPUs its threads are bound to, in thread order; None when the CPUs cannot
    give every stage `num_threads` cores of its own (then nothing is bound)."""
    cpus = sorted(set(cpu_ids))
    owned = pp_size * num_threads
    if pp_size < 1 or num_threads < 1 or owned > len(cpus):
        return None
    homes = [cpus[k * num_threads : (k + 1) * num_threads] for k in range(pp_size)]
    spare = cpus[owned:]
    # Stage k, then the stages after it, wrapping around: a lent thread borrows the next stage's cores first.
    return [tuple(c for j in range(pp_size) for c in homes[(k + j) % pp_size]) + tuple(spare) for k in range(pp_size)]


def affinity_env(cpus: Sequence[int], environ: Mapping[str, str]) -> dict[str, str]:
    """What a stage bound to `cpus` adds to its environment; nothing when `cpus` is empty or the user
    chose a binding."""
    if not cpus or any(key in environ for key in _USER_BINDING_ENV):
        return {}
    return {"GOMP_CPU_AFFINITY": " ".join(str(c) for c in cpus)}
