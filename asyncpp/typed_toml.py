"""TOML tables -> frozen dataclasses, checked key by key (`asyncpp.config` and the disagg config use it).

`build_dataclass(cls, table, prefix)` rejects unknown keys and values of the
wrong type with a `ConfigError` naming the dotted key (`cache.block_size`);
nested dataclasses, tuples and tables are built field by field.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


class ConfigError(ValueError):
    """A bad configuration; the message names the offending key."""


def build_dataclass(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"config section {where} must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s} (known in {where}: {', '.join(sorted(names))})")
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, prefix=f"{key}.")
    origin = typing.get_origin(hint)
    if origin is tuple:
        (item_type, _) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key {key} must be a list, got {type(value).__name__}")
        return tuple(coerce(item_type, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key} must be a table, got {type(value).__name__}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"config key {key} must be {hint.__name__}, got {type(value).__name__} ({value!r})")
    return value
