"""Where the stages run (`parallel.backend`): a registry of `StageGroup` makers, Ray imported only when chosen."""

from __future__ import annotations

from collections.abc import Callable

from asyncpp.config import ParallelConfig
from asyncpp.runtime.addresses import RunAddresses
from asyncpp.runtime.stage_group import StageGroup
from asyncpp.runtime.stage_process import StageArgs


def _local(stage_args: list[StageArgs], addresses: RunAddresses, parallel: ParallelConfig) -> StageGroup:
    return StageGroup(stage_args, addresses)


def _ray(stage_args: list[StageArgs], addresses: RunAddresses, parallel: ParallelConfig) -> StageGroup:
    from asyncpp.runtime.ray_backend import RayStageGroup

    return RayStageGroup(stage_args, addresses, parallel)


BACKENDS: dict[str, Callable[[list[StageArgs], RunAddresses, ParallelConfig], StageGroup]] = {"local": _local, "ray": _ray}


def create_stage_group(stage_args: list[StageArgs], addresses: RunAddresses, parallel: ParallelConfig) -> StageGroup:
    """The stage group of `parallel.backend` (validated by the config)."""
    return BACKENDS[parallel.backend](stage_args, addresses, parallel)
