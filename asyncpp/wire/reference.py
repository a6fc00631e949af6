"""The generic walk between typed messages and msgpack-ready values.

`to_plain(value)` turns a message (or any field of one) into msgpack-ready
values; `from_plain(hint, value, where)` rebuilds it from its type hints,
checking every field, and raises `WireError` naming the bad field. This walk
is the reference: the per-class functions of `asyncpp.wire.compiled` must
return what it returns, and the codec falls back to it whenever a frame does
not fit them, so errors read the same either way.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any


class WireError(ValueError):
    """A frame that does not decode into a known, well-typed message.

    `tag` and `request_id` are what the frame's head still says (None where it does
    not): a frame too big or too broken to decode may still name the request it was."""

    tag: str | None = None
    request_id: str | None = None


@cache
def hints_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def canonical_order(values: Any) -> list[Any]:
    """A set's items sorted (by repr where they do not compare): its iteration order depends on hashing."""
    try:
        return sorted(values)
    except TypeError:
        return sorted(values, key=repr)


def to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (frozenset, set)):
        return [to_plain(v) for v in canonical_order(value)]
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def from_plain(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise WireError(f"{where} must be a map, got {type(value).__name__}")
        hints = hints_of(hint)
        names = {f.name for f in dataclasses.fields(hint)}
        unknown = set(value) - names
        if unknown:
            # Keys may be str and bytes (msgpack bin) at once, which do not compare: sort by repr.
            raise WireError(f"{where}: unknown field {sorted(unknown, key=repr)[0]!r}")
        kwargs = {k: from_plain(hints[k], v, f"{where}.{k}") for k, v in value.items()}
        try:
            return hint(**kwargs)
        except TypeError as e:  # a required field is missing
            raise WireError(f"{where}: {e}") from e
        except ValueError as e:  # the class's own validation
            raise WireError(f"{where}: {e}") from e
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return from_plain(arg, value, where)
            except WireError as e:
                errors.append(str(e))
        raise WireError(errors[0] if len(errors) == 1 else f"{where}: no type of {hint} matches {value!r:.80}")
    if origin in (list, tuple, frozenset, set):
        if not isinstance(value, list):
            raise WireError(f"{where} must be a list, got {type(value).__name__}")
        item = args[0] if args else Any
        items = [from_plain(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return origin(items) if origin is not list else items
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where} must be a map, got {type(value).__name__}")
        key_t, val_t = args
        return {from_plain(key_t, k, f"{where} key"): from_plain(val_t, v, f"{where}[{k!r}]") for k, v in value.items()}
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise WireError(f"{where} must be a number, got {type(value).__name__}")
    if hint is int and isinstance(value, bool):
        raise WireError(f"{where} must be an integer, got bool")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise WireError(f"{where} must be {hint.__name__}, got {type(value).__name__}")
    return value
