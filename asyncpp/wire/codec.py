"""Typed msgpack codec for dataclass messages.

A frame is msgpack `[type_tag, {field: value}]`. Decoding looks the tag up
in a registry of message classes and rebuilds the dataclass from its type
hints, checking every field's type (nested dataclasses, lists, tuples,
dicts, frozensets, optionals, unions of simple types). Anything unexpected
raises `WireError` with the offending field named, so a bad frame from one
peer becomes an error reply, never a crash or a silently wrong value.

The generic walk below (`_to_plain`, `_from_plain`) is the reference; the
hot path uses per-class functions compiled from the same hints
(`asyncpp.wire.compiled`) and falls back to the reference whenever a frame
does not fit them, so errors read the same either way. Sets are sent
sorted, so equal messages always make equal frames.
"""

from __future__ import annotations

import dataclasses
import io
import types
import typing
from typing import Any

import msgpack

from asyncpp.wire.compiled import Mismatch, canonical_order, decoder_for, encoder_for, hints_of


class WireError(ValueError):
    """A frame that does not decode into a known, well-typed message.

    `tag` and `request_id` are what the frame's head still says (None where it does
    not): a frame too big or too broken to decode may still name the request it was."""

    tag: str | None = None
    request_id: str | None = None


_REGISTRY: dict[str, type] = {}


def message(tag: str):
    """Class decorator registering a dataclass under a wire tag."""

    def register(cls: type) -> type:
        if tag in _REGISTRY:
            raise ValueError(f"wire tag {tag!r} registered twice")
        cls.WIRE_TAG = tag
        _REGISTRY[tag] = cls
        return cls

    return register


def encode(msg: Any) -> bytes:
    cls = type(msg)
    tag = getattr(cls, "WIRE_TAG", None)
    if tag is None:
        raise TypeError(f"{cls.__name__} is not a registered wire message")
    try:
        return _pack([tag, encoder_for(cls)(msg)])
    except TypeError:  # a value unlike its hint (a set where a list is declared): walk it generically
        return _pack([tag, _to_plain(msg)])


def decode(frame: bytes, max_bytes: int | None = None) -> Any:
    try:
        return _decode(frame, max_bytes)
    except WireError as e:
        e.tag, e.request_id = _peek_head(frame)
        raise


def packed_size(value: Any) -> int:
    """Bytes `value` (a message, or any field of one) takes in a frame."""
    return len(_pack(_to_plain(value)))


def _peek_head(frame: bytes, max_fields: int = 8) -> tuple[str | None, str | None]:
    """(tag, request_id) from the start of a frame, reading no further than the request id:
    encoders write fields in declaration order, so it comes before a prompt of any size."""
    tag = request_id = None
    try:
        unpacker = msgpack.Unpacker(io.BytesIO(frame), raw=False)
        if unpacker.read_array_header() != 2:
            return None, None
        tag = unpacker.unpack()
        if not isinstance(tag, str):
            return None, None
        for _ in range(min(unpacker.read_map_header(), max_fields)):
            if unpacker.unpack() == "request_id":
                value = unpacker.unpack()
                request_id = value if isinstance(value, str) else None
                break
            unpacker.skip()
    except Exception:  # noqa: BLE001 - whatever msgpack raises: the head says no more
        pass
    return tag, request_id


def _decode(frame: bytes, max_bytes: int | None) -> Any:
    if max_bytes is not None and len(frame) > max_bytes:
        raise WireError(f"frame of {len(frame)} bytes is over the {max_bytes}-byte limit")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"malformed frame: {e}") from e
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], dict)):
        raise WireError("frame must be [type_tag, {fields}]")
    cls = _REGISTRY.get(obj[0])
    if cls is None:
        raise WireError(f"unknown message type {obj[0]!r}")
    try:
        return decoder_for(cls)(obj[1])
    except Mismatch:  # something is off: the reference walk finds it and names the field
        return _from_plain(cls, obj[1], cls.__name__)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (frozenset, set)):
        return [_to_plain(v) for v in canonical_order(value)]
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _from_plain(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise WireError(f"{where} must be a map, got {type(value).__name__}")
        hints = hints_of(hint)
        names = {f.name for f in dataclasses.fields(hint)}
        unknown = set(value) - names
        if unknown:
            # Keys may be str and bytes (msgpack bin) at once, which do not compare: sort by repr.
            raise WireError(f"{where}: unknown field {sorted(unknown, key=repr)[0]!r}")
        kwargs = {k: _from_plain(hints[k], v, f"{where}.{k}") for k, v in value.items()}
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
                return _from_plain(arg, value, where)
            except WireError as e:
                errors.append(str(e))
        raise WireError(errors[0] if len(errors) == 1 else f"{where}: no type of {hint} matches {value!r:.80}")
    if origin in (list, tuple, frozenset, set):
        if not isinstance(value, list):
            raise WireError(f"{where} must be a list, got {type(value).__name__}")
        item = args[0] if args else Any
        items = [_from_plain(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return origin(items) if origin is not list else items
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where} must be a map, got {type(value).__name__}")
        key_t, val_t = args
        return {_from_plain(key_t, k, f"{where} key"): _from_plain(val_t, v, f"{where}[{k!r}]") for k, v in value.items()}
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise WireError(f"{where} must be a number, got {type(value).__name__}")
    if hint is int and isinstance(value, bool):
        raise WireError(f"{where} must be an integer, got bool")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise WireError(f"{where} must be {hint.__name__}, got {type(value).__name__}")
    return value
