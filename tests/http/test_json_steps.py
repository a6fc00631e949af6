"""`loads_in_steps` is `json.loads`: the same value or the same exception, for any body; a big body
is parsed one top-level array element per call, so that other threads run between them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncpp.http import json_steps
from asyncpp.http.json_steps import loads_in_steps

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
SPACING = st.sampled_from([None, 1, "\t", "\n\r "])


def same_as_json_loads(body: bytes) -> None:
    try:
        expected = json.loads(body)
    except (ValueError, RecursionError) as e:
        with pytest.raises(type(e)) as info:
            loads_in_steps(body)
        assert str(info.value) == str(e)
    else:
        assert repr(loads_in_steps(body)) == repr(expected)  # repr: NaN != NaN


@given(value=JSON_VALUES, indent=SPACING)
def test_any_json_value_parses_as_json_loads_parses_it(value, indent):
    same_as_json_loads(json.dumps(value, indent=indent).encode())


@given(body=st.binary(max_size=40) | JSON_VALUES.map(lambda v: json.dumps(v).encode()[:-1]))
def test_any_bytes_get_the_same_value_or_error(body):
    same_as_json_loads(body)


@pytest.mark.parametrize("body", [
    b'{"a": [1, 2,]}', b'{"a": 1,}', b'{"a" 1}', b'{1: 2}', b'{"a": [1 2]}', b'{"a": []} x', b'{"a": [}',
    b'\xef\xbb\xbf{"a": [1]}', '{"a": ["\u00e9"]}'.encode("utf-16"), b'{"a": ["\xed\xa0\x80"]}',
    b'{"a": [NaN, Infinity]}', b'{"a": [1], "a": [2]}', b' {"a" : [ ] , "b" : { } } ', b'{}', b'[1, 2]',
    b'{"a": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}", b'{"a": [1' + b"0" * 5000 + b"]}",
    b'{}x', b'{"a": []}x', b'{"a": [1]}x', b'{"a": {}}x',
])  # fmt: skip
def test_edge_bodies_get_the_same_value_or_error(body):
    same_as_json_loads(body)


def test_a_big_body_is_parsed_in_calls_of_one_element_each(monkeypatch):
    """`json.loads` holds the GIL for its whole call (0.1-0.4 s for this body); in steps, no call of
    the C decoder parses more than one message, and other threads run between them."""
    calls: list[int] = []  # characters each call parsed

    class Recording(json.JSONDecoder):
        def raw_decode(self, s, idx=0):
            value, end = super().raw_decode(s, idx)
            calls.append(end - idx)
            return value, end

    monkeypatch.setattr(json_steps, "_DECODER", Recording())
    message = {"role": "user", "content": ""}
    body = json.dumps({"messages": [message] * 1_000_000, "max_tokens": 4}).encode()
    assert loads_in_steps(body) == json.loads(body)
    assert len(calls) == 1_000_000 + 3 and max(calls) == len(json.dumps(message))  # (and the 2 keys and 4)
