"""Connect to a Ray cluster and reserve one placement-group bundle per stage; every refusal names its key.

A bundle holds a stage's CPU threads (`parallel.num_threads`) and, for a
CUDA stage, one GPU. `parallel.placement = "spread"` asks Ray to put the
bundles on different nodes where it can (SPREAD), `"pack"` on as few as it
can (PACK). A group Ray cannot place (more stages than the cluster holds, a
GPU no node has) fails here, before any stage starts, and is removed.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from asyncpp.config import ConfigError
from asyncpp.device import is_cuda

PLACEMENT_TIMEOUT_S = 30.0
NAMESPACE = "asyncpp"
_STRATEGIES = {"spread": "SPREAD", "pack": "PACK"}


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("parallel.backend = 'ray' needs Ray: pip install 'asyncpp[ray]'") from e
    return ray


def connect(address: str) -> None:
    """`ray.init` on an existing cluster (never starts one); an unreachable one fails naming the key."""
    ray = import_ray()
    host_port = _host_port(address)
    if host_port is not None:  # fail in seconds, not after Ray's own long retries
        try:
            socket.create_connection(host_port, timeout=3.0).close()
        except OSError as e:
            raise ConfigError(f"parallel.ray_address {address!r} is unreachable: {e}") from e
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="warning", log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"parallel.ray_address {address!r}: cannot connect to a Ray cluster: {e}") from e


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a "host:port" or "ray://host:port" address; None for "auto" and the like."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def bundles_for(devices: list[str], num_threads: int) -> list[dict[str, float]]:
    return [{"CPU": float(num_threads), **({"GPU": 1.0} if is_cuda(d) else {})} for d in devices]


@dataclass
class Placement:
    group: object  # ray.util.placement_group.PlacementGroup
    bundles: list[dict[str, float]]

    def strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def reserve(devices: list[str], num_threads: int, placement: str, name: str) -> Placement:
    """A ready placement group with one bundle per stage; `ConfigError` if the cluster cannot hold it."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = bundles_for(devices, num_threads)
    total = ray.cluster_resources()
    for resource, key in (("CPU", "parallel.pp_size"), ("GPU", "model.device")):
        needed = sum(b.get(resource, 0.0) for b in bundles)
        if needed > total.get(resource, 0.0):
            raise ConfigError(
                f"{key}: {len(bundles)} stages need {needed:g} {resource} in all "
                f"(parallel.num_threads each{', one GPU per CUDA stage' if resource == 'GPU' else ''}); "
                f"the Ray cluster has {total.get(resource, 0.0):g}"
            )
    group = placement_group(bundles, strategy=_STRATEGIES[placement], name=name)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - GetTimeoutError and kin: Ray cannot place it
        remove_placement_group(group)
        raise ConfigError(
            f"parallel.placement = {placement!r}: Ray could not place {len(bundles)} stage bundles {bundles[0]} "
            f"within {PLACEMENT_TIMEOUT_S:.0f} s (parallel.pp_size and parallel.num_threads against the nodes' "
            f"free resources): {type(e).__name__}"
        ) from e
    return Placement(group, bundles)
