"""A prefill/decode deployment's config: a normal engine config plus a `[disagg]` table.

Every table other than `[disagg]` is the shared base of both engines (and
the router's `[server]`: its port, HTTP front end, grace period).
`[disagg.prefill]` and `[disagg.decode]` hold dotted-key overrides of that
base for one engine each (`"parallel.pp_size" = 2`); the launcher writes each
engine's config out as a normal TOML file and starts it as a child
`python -m asyncpp.launch`. Each derived config is validated here with
`config_from_dict`, so a bad key fails before anything starts, named with its
engine (`disagg.prefill: unknown config key ...`).

Per engine: `server.port` is 0 (any free port; an override may fix it),
`server.http_port` is 0 (the one HTTP front end talks to the router), and
`kv_transfer.kv_role` is "producer" (prefill) or "consumer" (decode) when a
connector is set and the role is left unset; the other role is refused.
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncpp.config import ConfigError, EngineConfig, config_from_dict
from asyncpp.typed_toml import build_dataclass

ROLES = ("prefill", "decode")
KV_ROLES = {"prefill": "producer", "decode": "consumer"}
HANDOVERS = ("early", "after_prefill")


@dataclass(frozen=True)
class DisaggSection:
    """The `[disagg]` table: how the router watches its engines, and each engine's overrides."""

    health_interval_s: float = 0.5  # a health check per engine this often
    health_timeout_s: float = 1.0  # no reply within it: the engine is dead (noticed within interval + timeout)
    start_timeout_s: float = 600.0  # both engines ready (stages loaded) and handshakes exchanged within it
    # Give each engine CPUs of its own (its pp_size * num_threads, the rest to the decode engine)
    # when the machine has enough; otherwise both share every CPU and neither pins its threads.
    split_cpus: bool = True
    # "early": the decode engine is given each request with the prefill engine, and reads the
    # prompt's KV as soon as the prefill stages have it; "after_prefill": once the first token is.
    handover: str = "early"
    prefill: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    decode: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("health_interval_s", "health_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ConfigError(f"disagg.{name} must be a positive number of seconds, got {value!r}")
        if self.handover not in HANDOVERS:
            raise ConfigError(f"disagg.handover must be one of {list(HANDOVERS)}, got {self.handover!r}")


@dataclass(frozen=True)
class DisaggConfig:
    section: DisaggSection
    shared: EngineConfig  # the shared tables as a config; its [server] is the router's (port, HTTP, grace)
    engines: dict[str, dict[str, Any]]  # role -> its derived tables, valid for `config_from_dict`

    def engine_config(self, role: str) -> EngineConfig:
        return config_from_dict(self.engines[role])

    def num_cpus_needed(self, role: str) -> int:
        parallel = self.engine_config(role).parallel
        return parallel.pp_size * parallel.num_threads


def read_toml(path: str | Path) -> dict[str, Any] | None:
    """The file's tables, or None when it is missing or not TOML (`load_config` then says why)."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None


def is_disagg_config(path: str | Path) -> bool:
    data = read_toml(path)
    return data is not None and "disagg" in data


def load_disagg_config(path: str | Path) -> DisaggConfig:
    data = read_toml(path)
    if data is None or "disagg" not in data:
        raise ConfigError(f"{path}: not a prefill/decode config (no [disagg] table)")
    return disagg_config_from_dict(data)


def disagg_config_from_dict(data: dict[str, Any]) -> DisaggConfig:
    section = build_dataclass(DisaggSection, data["disagg"], prefix="disagg.")
    base = {k: v for k, v in data.items() if k != "disagg"}
    shared = config_from_dict(base)  # the shared tables must be a valid config on their own
    engines = {}
    for role in ROLES:
        engines[role] = engine_sections(base, getattr(section, role), role)
        try:
            config = config_from_dict(engines[role])
        except ConfigError as e:
            raise ConfigError(f"disagg.{role}: {e}") from e
        check_role(role, config)
    return DisaggConfig(section, shared, engines)


def engine_sections(base: dict[str, Any], overrides: Any, role: str) -> dict[str, Any]:
    """`base` with one engine's dotted-key overrides applied (TOML tables as dicts)."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"config section disagg.{role} must be a table of dotted keys")
    sections = copy.deepcopy(base)
    for key, value in flatten(overrides):
        section, _, name = key.partition(".")
        if not name or "." in name:
            raise ConfigError(f"disagg.{role}: {key!r} must be a dotted key 'section.key' (\"parallel.pp_size\" = 2)")
        if key == "server.http_port":
            raise ConfigError(f"disagg.{role}: server.http_port is the router's (set it in [server])")
        table = sections.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"disagg.{role}: {section} is not a table in the base config")
        table[name] = value
    parallel = sections.setdefault("parallel", {})
    split = parallel.get("layer_split") or []
    if split and len(split) != parallel.get("pp_size", 1) and not _overrides(overrides, "parallel.layer_split"):
        parallel["layer_split"] = []  # the base split was for another pp_size: split evenly
    server = sections.setdefault("server", {})
    if not _overrides(overrides, "server.port"):
        server["port"] = 0
    server["http_port"] = 0
    kv = sections.get("kv_transfer", {})
    if kv.get("connector", "none") != "none" and not kv.get("kv_role"):
        kv["kv_role"] = KV_ROLES[role]
    return sections


def check_role(role: str, config: EngineConfig) -> None:
    if config.parallel.dp_size != 1:  # its router would stand between the two and pass no handshakes
        raise ConfigError(f"disagg.{role}: parallel.dp_size must be 1 in a prefill/decode deployment, "
                          f"got {config.parallel.dp_size}")  # fmt: skip
    kv_role = config.kv_transfer.kv_role
    if config.kv_transfer.is_enabled and kv_role != KV_ROLES[role]:
        raise ConfigError(f"disagg.{role}: kv_transfer.kv_role must be {KV_ROLES[role]!r} (or unset), got {kv_role!r}")


def flatten(overrides: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Quoted dotted keys ("parallel.pp_size" = 2) and TOML's own nesting (parallel.pp_size = 2,
    or a [disagg.prefill.parallel] table) read the same: (dotted key, value) pairs. A table value
    under a key that is already `section.key` (kv_transfer.options) stays a value."""
    pairs = []
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and "." not in dotted:
            pairs += flatten(value, f"{dotted}.")
        else:
            pairs.append((dotted, value))
    return pairs


def _overrides(overrides: dict[str, Any], key: str) -> bool:
    return any(k == key for k, _ in flatten(overrides))


def split_cpus(cpu_ids: list[int], needs: list[int]) -> list[tuple[int, ...]] | None:
    """Consecutive CPUs for each engine, `needs[i]` for engine i and the rest to the last; None
    when there are fewer CPUs than the engines need together (then they share all)."""
    if sum(needs) > len(cpu_ids):
        return None
    slices, start = [], 0
    for i, need in enumerate(needs):
        end = len(cpu_ids) if i == len(needs) - 1 else start + need
        slices.append(tuple(cpu_ids[start:end]))
        start = end
    return slices
