"""Typed msgpack codec for dataclass messages.

A frame is msgpack `[type_tag, {field: value}]`. Decoding looks the tag up
in a registry of message classes and rebuilds the dataclass from its type
hints, checking every field's type (nested dataclasses, lists, tuples,
dicts, frozensets, optionals, unions of simple types). Anything unexpected
raises `WireError` with the offending field named, so a bad frame from one
peer becomes an error reply, never a crash or a silently wrong value.

The generic walk (`to_plain`, `from_plain`, in `asyncpp.wire.reference`) is
the reference; the hot path uses per-class functions compiled from the same
hints (`asyncpp.wire.compiled`) and falls back to the reference whenever a
frame does not fit them, so errors read the same either way. Sets are sent
sorted, so equal messages always make equal frames.
"""

from __future__ import annotations

import io
from typing import Any

import msgpack

from asyncpp.wire.compiled import Mismatch, decoder_for, encoder_for
from asyncpp.wire.reference import WireError, from_plain, to_plain

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
        return _pack([tag, to_plain(msg)])


def decode(frame: bytes, max_bytes: int | None = None) -> Any:
    try:
        return _decode(frame, max_bytes)
    except WireError as e:
        e.tag, e.request_id = _peek_head(frame)
        raise


def packed_size(value: Any) -> int:
    """Bytes `value` (a message, or any field of one) takes in a frame."""
    return len(_pack(to_plain(value)))


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
        return from_plain(cls, obj[1], cls.__name__)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)
