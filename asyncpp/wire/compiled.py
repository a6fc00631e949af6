"""Per-type encoders and decoders, built once per message class from its type hints.

`asyncpp.wire.reference` walks values generically (`to_plain`, `from_plain`):
every int of every token list costs a recursive call and a few `isinstance`
checks, and plans, stage outputs and deltas cross a socket every step. These
compiled functions do the same work with the type decisions taken ahead of
time: a `list[int]` is checked with one C-level pass and passed through.

Contract (the generic walker stays the reference):
* `encoder_for(hint)(value)` returns what `to_plain(value)` returns, up to
  tuples standing for lists (msgpack packs both as arrays). What it returns
  may share the value's own lists and maps (a dataclass of plain fields
  gives its instance dict): it is for packing, never to be changed.
* `decoder_for(hint)(value)` returns what `from_plain(hint, value, ...)`
  returns for every value msgpack can produce, or raises `Mismatch` where the
  reference would raise (or, for a hint it does not compile, where it has not
  checked). It never names the bad field: on `Mismatch` the codec re-decodes
  with the reference, which raises the `WireError` naming it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

from asyncpp.wire.reference import WireError, canonical_order, from_plain, hints_of, to_plain

Encoder = Callable[[Any], Any]
Decoder = Callable[[Any], Any]

_NONE = type(None)
_SCALARS = (int, float, str, bool, bytes, _NONE)
_EXACT = (int, str, bool, bytes, _NONE)  # decided by `type(v)` alone (a bool is no int; a float may be an int)
_SEQUENCES = (list, tuple, frozenset, set)


class Mismatch(Exception):
    """The value is not of the hinted type (or might not be): decode it with the reference walker."""


def _args(hint: Any) -> tuple[Any, ...]:
    return tuple(a for a in typing.get_args(hint) if a is not Ellipsis)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


@cache
def is_plain(hint: Any) -> bool:
    """Values of this type are already msgpack-ready: scalars, and lists / tuples / maps of them."""
    if hint in _SCALARS:
        return True
    origin = typing.get_origin(hint)
    if origin in (list, tuple, dict) or _is_union(hint):
        return all(is_plain(a) for a in _args(hint))
    return False


# ---- encoding ---------------------------------------------------------------------------------
@cache
def encoder_for(hint: Any) -> Encoder | None:
    """None where the value goes to msgpack as it is; else a function making it msgpack-ready."""
    if is_plain(hint):
        return None
    if dataclasses.is_dataclass(hint):
        return _dataclass_encoder(hint)
    origin, args = typing.get_origin(hint), _args(hint)
    if origin in _SEQUENCES and len(args) == 1:
        item = encoder_for(args[0])
        order = canonical_order if origin in (frozenset, set) else None
        if item is None:
            return order or list
        if order is None:
            inner = _optional_inner(args[0])
            if inner is not None:  # columns of mostly None (a step's deltas' logprobs): no call for a None
                return lambda value: [None if v is None else inner(v) for v in value]
            return lambda value: [item(v) for v in value]
        return lambda value: [item(v) for v in order(value)]
    inner = _optional_inner(hint)
    if inner is not None:
        return lambda value: None if value is None else inner(value)
    return to_plain


def _optional_inner(hint: Any) -> Encoder | None:
    """For `X | None` where X needs encoding: X's encoder (None for any other hint)."""
    args = _args(hint)
    if not (_is_union(hint) and len(args) == 2 and _NONE in args):
        return None
    (inner,) = [a for a in args if a is not _NONE]
    return encoder_for(inner)


def _dataclass_encoder(cls: type) -> Encoder:
    hints = hints_of(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    plain = [n for n in names if encoder_for(hints[n]) is None]
    if len(plain) == len(names):
        num_fields = len(names)

        def encode_plain(obj: Any) -> Any:
            # Its instance dict is the field map itself, in field order (`__init__` sets them in
            # order): a plan's hundreds of entries are packed from it as they are. One holding
            # anything else (set behind the dataclass's back) is mapped field by field.
            if type(obj) is not cls:
                return to_plain(obj)
            fields = getattr(obj, "__dict__", None)
            if fields is not None and len(fields) == num_fields:
                return fields
            return {n: getattr(obj, n) for n in names}

        return encode_plain
    fields = [(n, encoder_for(hints[n])) for n in names]

    def encode(obj: Any) -> Any:
        if type(obj) is not cls:  # a subclass or a stand-in: the generic walk handles it
            return to_plain(obj)
        return {n: getattr(obj, n) if enc is None else enc(getattr(obj, n)) for n, enc in fields}

    return encode


# ---- decoding ---------------------------------------------------------------------------------
def exact_types(hint: Any) -> frozenset[type] | None:
    """The types a value of `hint` may have, when one `type(v) in ...` check decides it (int, str | None)."""
    members = _args(hint) if _is_union(hint) else (hint,)
    if all(m in _EXACT for m in members):
        return frozenset(members)
    return None


@cache
def decoder_for(hint: Any) -> Decoder:
    if hint is Any:
        return _identity
    if dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint)
    allowed = exact_types(hint)
    if allowed is not None:
        return _exact(allowed)
    if hint is float:
        return _float
    origin, args = typing.get_origin(hint), _args(hint)
    if _is_union(hint):
        return _union_decoder(hint, args)
    if origin in _SEQUENCES:
        return _sequence_decoder(origin, args[0] if args else Any)
    if origin is dict and len(args) == 2:
        key, val = decoder_for(args[0]), decoder_for(args[1])

        def decode_dict(value: Any) -> Any:
            if type(value) is not dict:
                raise Mismatch
            return {key(k): val(v) for k, v in value.items()}

        return decode_dict
    return _uncompiled(hint)


def _identity(value: Any) -> Any:
    return value


def _exact(allowed: frozenset[type]) -> Decoder:
    def decode(value: Any) -> Any:
        if type(value) not in allowed:
            raise Mismatch
        return value

    return decode


def _float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise Mismatch


def _union_decoder(hint: Any, args: tuple[Any, ...]) -> Decoder:
    allows_none = _NONE in args
    options = [decoder_for(a) for a in args if a is not _NONE]

    def decode(value: Any) -> Any:
        if value is None and allows_none:
            return None
        for option in options:  # first match wins, as in the reference
            try:
                return option(value)
            except Mismatch:
                continue
        raise Mismatch

    return decode


def _sequence_decoder(origin: type, item_hint: Any) -> Decoder:
    wrap = None if origin is list else origin
    allowed = exact_types(item_hint)
    if allowed is not None:

        def decode_scalars(value: Any) -> Any:
            if type(value) is not list or not set(map(type, value)) <= allowed:
                raise Mismatch
            return value if wrap is None else wrap(value)  # msgpack made `value`: nobody else holds it

        return decode_scalars
    item = decoder_for(item_hint)

    def decode(value: Any) -> Any:
        if type(value) is not list:
            raise Mismatch
        items = [item(v) for v in value]
        return items if wrap is None else wrap(items)

    return decode


def _dataclass_decoder(cls: type) -> Decoder:
    hints = hints_of(cls)
    fields = {f.name: decoder_for(hints[f.name]) for f in dataclasses.fields(cls)}

    def decode(value: Any) -> Any:
        if type(value) is not dict:
            raise Mismatch
        try:
            kwargs = {k: fields[k](v) for k, v in value.items()}
        except (KeyError, TypeError):  # an unknown field (TypeError: an unhashable key)
            raise Mismatch from None
        try:
            return cls(**kwargs)
        except (TypeError, ValueError):  # a missing field, or the class's own validation
            raise Mismatch from None

    return decode


def _uncompiled(hint: Any) -> Decoder:
    def decode(value: Any) -> Any:
        try:
            return from_plain(hint, value, "")
        except WireError:
            raise Mismatch from None

    return decode
