"""A data-parallel deployment's replicas: each one a normal engine config, derived from the deployment's.

`parallel.dp_size = N` (N > 1) makes `asyncpp.launch` start N engines of the
same config (replicas) behind one router (`asyncpp.dp.deploy`). Each replica's
tables are the deployment's with:
- `parallel.dp_size` 1;
- `server.port` 0 (any free port) and `server.http_port` 0: clients and the
  one HTTP front end talk to the router, which has the deployment's ports;
- `server.engine_secret` the deployment's (the router's links present it);
- a "dir" KV store in a subdirectory of its own (`replica-I`), so that no two
  replicas write the same files;
- `parallel.pin_threads` false when the replicas share every CPU (there are
  fewer CPUs than their stages' threads together): threads of two replicas
  pinned to the same cores would collide.

The long-prompt replica (`parallel.long_prompt_pp_size`) is derived the same
way, with that many stages over every CPU (`layer_split` balanced,
`max_steps_in_flight` its own default) and its KV store's subdirectory
`long-prompts`.

A prefill/decode role (`kv_transfer.kv_role`) is refused: the router passes no
KV handshakes between engines; so are Ray's stages (`parallel.backend`): the
replicas run on this host. So is a deployment whose weights (once per
engine) and KV caches cannot fit in the host's memory (`check_dp_memory`).
Each derived config is validated here, so a bad value fails before anything
starts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from asyncpp.config import ConfigError, EngineConfig, config_from_dict
from asyncpp.host_memory import check_host_memory
from asyncpp.weights import read_arch


def check_dp(config: EngineConfig) -> None:
    """`ConfigError` if `config` cannot be served by replicas behind a router."""
    if config.parallel.backend != "local":
        raise ConfigError(
            f"parallel.dp_size = {config.parallel.dp_size} runs its replicas on this host: parallel.backend "
            f"{config.parallel.backend!r} takes one engine (dp_size = 1, and pp_size its stages)"
        )
    if config.kv_transfer.kv_role:
        raise ConfigError(
            f"parallel.dp_size = {config.parallel.dp_size} cannot take kv_transfer.kv_role "
            f"{config.kv_transfer.kv_role!r}: the data-parallel router passes no KV handshakes "
            "(an engine of a prefill/decode pair is one engine: dp_size = 1, `asyncpp serve -dp 1`; a "
            "prefill/decode deployment is a [disagg] table)"
        )


def check_dp_memory(config: EngineConfig) -> None:
    """`ConfigError` if the replicas and the long-prompt engine cannot fit in the host's memory
    (`asyncpp.host_memory`). A model that cannot be read is left to the replicas, which say why as they start."""
    try:
        arch = read_arch(config.model.source, config.model.path_or_none)
    except (OSError, ValueError):
        return
    check_host_memory(config, arch, config.parallel.engine_stages)


def replica_sections(
    sections: dict[str, Any], index: int, engine_secret: str, *, share_cpus: bool
) -> dict[str, Any]:
    """Replica `index`'s tables (valid for `config_from_dict`, else `ConfigError` naming the replica)."""
    parallel = {"pin_threads": False} if share_cpus else {}
    return _derived(sections, f"replica-{index}", engine_secret, parallel)


def long_prompt_sections(sections: dict[str, Any], pp_size: int, engine_secret: str) -> dict[str, Any]:
    """The long-prompt replica's tables: `pp_size` stages, balanced."""
    parallel = {"pp_size": pp_size, "layer_split": [], "max_steps_in_flight": 0}
    return _derived(sections, "long-prompts", engine_secret, parallel)


def _derived(sections: dict[str, Any], name: str, engine_secret: str, parallel: dict[str, Any]) -> dict[str, Any]:
    derived = copy.deepcopy(sections)
    derived.setdefault("parallel", {}).update(parallel, dp_size=1)
    derived["parallel"].pop("long_prompt_pp_size", None)  # one engine: none beside it
    server = derived.setdefault("server", {})
    server.update(port=0, http_port=0, engine_secret=engine_secret)
    kv = derived.get("kv_transfer", {})
    if kv.get("store") == "dir" and kv.get("store_path"):
        kv["store_path"] = str(Path(kv["store_path"]) / name)
    try:
        config_from_dict(derived)
    except ConfigError as e:
        raise ConfigError(f"{name.replace('-', ' ')}: {e}") from e
    return derived


def replica_cpus(cpu_ids: list[int], dp_size: int, need: int) -> list[tuple[int, ...]] | None:
    """Consecutive CPUs for each replica, as even as possible (the first ones get any extra); None
    when some replica would get fewer than `need` (its stages' threads): then all share every CPU."""
    per, extra = divmod(len(cpu_ids), dp_size)
    if per < need:
        return None
    shares, start = [], 0
    for i in range(dp_size):
        end = start + per + (1 if i < extra else 0)
        shares.append(tuple(cpu_ids[start:end]))
        start = end
    return shares
