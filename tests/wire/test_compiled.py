"""The compiled codec path agrees with the reference walk: same frames, same values, same refusals."""

from __future__ import annotations

import copy
import random

import msgpack
import pytest

from asyncpp.wire.codec import _REGISTRY, decode, encode
from asyncpp.wire.compiled import Mismatch, decoder_for, encoder_for
from asyncpp.wire.reference import WireError, from_plain, to_plain
from tests.wire.test_messages import MESSAGES, WRONG_TYPES

LEAVES = [0, 7, -1, 1.5, 2.0, True, False, None, "", "x", b"x", [], [1, 2], ["a"], [1.5], {}, {"a": 1}, [None], [[]]]


def plain(msg):
    return msgpack.unpackb(msgpack.packb(to_plain(msg), use_bin_type=True), raw=False)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_compiled_encoder_makes_the_reference_frame(msg):
    fast = encoder_for(type(msg))(msg)
    assert msgpack.packb(fast, use_bin_type=True) == msgpack.packb(to_plain(msg), use_bin_type=True)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_compiled_decoder_builds_the_reference_value(msg):
    fields = plain(msg)
    fast = decoder_for(type(msg))(copy.deepcopy(fields))
    ref = from_plain(type(msg), copy.deepcopy(fields), type(msg).__name__)
    assert fast == ref == msg
    assert _types(fast) == _types(ref)


@pytest.mark.parametrize("frame,words", WRONG_TYPES)
def test_compiled_decoder_refuses_what_the_reference_refuses(frame, words):
    tag, fields = msgpack.unpackb(frame, raw=False)
    cls = _REGISTRY[tag]
    with pytest.raises(Mismatch):
        decoder_for(cls)(fields)
    with pytest.raises(WireError, match=words):  # and the codec still names the field
        decode(frame)


def test_a_value_unlike_its_hint_still_encodes():
    from asyncpp.wire.client_msgs import RequestDelta

    odd = RequestDelta("r", "", {3})  # a set where list[int] is declared: msgpack alone refuses it
    assert decode(encode(odd)) == RequestDelta("r", "", [3])


def test_random_mutations_decode_the_same_both_ways():
    rng = random.Random(0)
    num_checked = 0
    for _ in range(3000):
        msg = rng.choice(MESSAGES)
        cls = type(msg)
        fields = plain(msg)
        for _ in range(rng.randint(1, 3)):
            _mutate(fields, rng)
        try:
            ref = from_plain(cls, copy.deepcopy(fields), cls.__name__)
        except WireError:
            with pytest.raises(Mismatch):
                decoder_for(cls)(copy.deepcopy(fields))
            continue
        fast = decoder_for(cls)(copy.deepcopy(fields))
        assert fast == ref and _types(fast) == _types(ref), (fields, fast, ref)
        num_checked += 1
    assert num_checked > 200  # enough mutations were still valid to compare values, not just refusals


def _mutate(node, rng) -> None:
    """Replace, drop or add one entry somewhere inside the plain tree `node` (in place)."""
    path = []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        child = node[key]
        if not isinstance(child, (dict, list)) or not child:
            break
        path.append(key)
        node = child
    if isinstance(node, dict):
        action = rng.random()
        if node and action < 0.7:
            node[rng.choice(list(node))] = copy.deepcopy(rng.choice(LEAVES))
        elif node and action < 0.85:
            del node[rng.choice(list(node))]
        else:
            node[rng.choice(["extra", "text", "step_id", "nonce"])] = copy.deepcopy(rng.choice(LEAVES))
    elif isinstance(node, list):
        if node and rng.random() < 0.7:
            node[rng.randrange(len(node))] = copy.deepcopy(rng.choice(LEAVES))
        else:
            node.append(copy.deepcopy(rng.choice(LEAVES)))


def _types(value):
    """The value's shape with every container and scalar type, to compare decodes exactly."""
    if isinstance(value, (list, tuple, frozenset, set)):
        return (type(value).__name__, [_types(v) for v in value])
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), _types(v)) for k, v in value.items()))
    if hasattr(value, "__dataclass_fields__"):
        return (type(value).__name__, [(n, _types(getattr(value, n))) for n in value.__dataclass_fields__])
    return type(value).__name__


def test_a_plain_dataclass_holding_an_extra_attribute_still_sends_only_its_fields():
    from asyncpp.core.plan import ScheduledRequest

    entry = ScheduledRequest("a", [5], 3, [0], True)
    assert encoder_for(ScheduledRequest)(entry) == to_plain(entry)
    object.__setattr__(entry, "note", "set behind the dataclass's back")
    assert encoder_for(ScheduledRequest)(entry) == to_plain(entry) and "note" not in encoder_for(ScheduledRequest)(entry)
