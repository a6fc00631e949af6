"""Stages as Ray actors on a Ray cluster (`parallel.backend = "ray"`); imported only when chosen.

`placement.py` connects to the cluster and reserves one bundle per stage,
`actor.py` is the actor that runs the unchanged stage loop (`stage_main`),
`addresses.py` the tcp:// control plane with its per-run token, and
`group.py` the `StageGroup` the engine drives, as it drives local processes.
"""

from asyncpp.runtime.ray_backend.group import RayStageGroup

__all__ = ["RayStageGroup"]
