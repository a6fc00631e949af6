"""`loads_in_steps`: `json.loads` of a big body in many short calls, so that a thread parsing it lets
the event loop run.

`json.loads` is one C call: on an executor thread it still holds the GIL
from start to end (~0.5 s for 30 MB of small objects), and the loop waits
as long. Here the top-level object is walked in Python and each of its
values, and each element of a value that is an array (a million chat
messages, prompt token ids), is parsed by the standard decoder on its own,
so that the GIL changes hands between them. What this walk does not expect
(another top-level value, malformed JSON, a BOM) goes to `json.loads`,
whose result and errors are therefore always the ones callers get.
"""

from __future__ import annotations

import json
import re
from typing import Any

_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_DECODER = json.JSONDecoder()  # as `json.loads` without arguments decodes


def loads_in_steps(body: bytes) -> Any:
    """`json.loads(body)`, in steps; the same value, or the same exception."""
    try:
        return _object(body.decode(json.detect_encoding(body), "surrogatepass"))
    except (ValueError, IndexError, RecursionError):  # not the shape walked here: the standard way says why
        return json.loads(body)


def _object(text: str) -> dict[str, Any]:
    skip, decode = _WHITESPACE.match, _DECODER.raw_decode
    obj: dict[str, Any] = {}
    i = skip(text, _expect(text, skip(text, 0).end(), "{")).end()
    if text[i] == "}":
        return _end(text, i + 1, obj)
    while True:
        if text[i] != '"':
            raise ValueError("a key must be a string")
        key, i = decode(text, i)
        i = skip(text, _expect(text, skip(text, i).end(), ":")).end()
        obj[key], i = _array(text, i) if text[i] == "[" else decode(text, i)
        i = skip(text, i).end()
        if text[i] == "}":
            return _end(text, i + 1, obj)
        i = skip(text, _expect(text, i, ",")).end()


def _array(text: str, i: int) -> tuple[list[Any], int]:
    """The array at `text[i]` ("["), element by element, and the index past it."""
    skip, decode = _WHITESPACE.match, _DECODER.raw_decode
    items: list[Any] = []
    i = skip(text, i + 1).end()
    if text[i] == "]":
        return items, i + 1
    while True:
        item, i = decode(text, i)
        items.append(item)
        i = skip(text, i).end()
        if text[i] == "]":
            return items, i + 1
        i = skip(text, _expect(text, i, ",")).end()


def _end(text: str, i: int, obj: dict[str, Any]) -> dict[str, Any]:
    if _WHITESPACE.match(text, i).end() != len(text):
        raise ValueError("extra data")
    return obj


def _expect(text: str, i: int, char: str) -> int:
    if text[i] != char:
        raise ValueError(f"expected {char!r}")
    return i + 1
