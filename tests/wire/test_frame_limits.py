"""Frames over a limit: the sender refuses them, the reader still learns whose request a bad one was."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from asyncpp.wire.client_msgs import AbortRequest, GenerateRequest
from asyncpp.wire.codec import WireError, decode, encode, packed_size
from asyncpp.wire.queues import DealerQueue, FrameTooLargeError


def decode_error(frame: bytes, max_bytes: int | None = None) -> WireError:
    with pytest.raises(WireError) as info:
        decode(frame, max_bytes)
    return info.value


def test_a_bad_frame_still_names_its_tag_and_request_id_when_its_head_says_them():
    big = encode(GenerateRequest("r-1", "x" * 10_000, {"max_tokens": 2}))
    e = decode_error(big, max_bytes=1000)
    assert "over the 1000-byte limit" in str(e) and (e.tag, e.request_id) == ("generate", "r-1")
    e = decode_error(big[:-10])  # truncated: the prompt is cut, the head is whole
    assert "malformed frame" in str(e) and (e.tag, e.request_id) == ("generate", "r-1")
    e = decode_error(encode(AbortRequest("r-2"))[:-1])
    assert (e.tag, e.request_id) == ("abort", None)  # "r-2" itself is what was cut
    e = decode_error(msgpack.packb(["generate", {"request_id": 7, "prompt": "x"}]))
    assert (e.tag, e.request_id) == ("generate", None)  # not a string: no id
    e = decode_error(b"\xc1 not msgpack")
    assert (e.tag, e.request_id) == (None, None)


def test_packed_size_is_a_fields_share_of_the_frame():
    request = GenerateRequest("r", "x" * 1000, {"stop": ["y" * 5000]})
    assert packed_size(request.sampling_params) > 5000 > packed_size(request.prompt) > 1000
    assert len(encode(request)) > packed_size(request.prompt) + packed_size(request.sampling_params)


async def test_a_dealer_refuses_a_frame_over_its_limit_before_sending():
    queue = DealerQueue("tcp://127.0.0.1:1", max_frame_bytes=100)  # nothing listens: nothing may be sent
    try:
        with pytest.raises(FrameTooLargeError) as info:
            await queue.put(GenerateRequest("r", "x" * 200))
        assert info.value.max_bytes == 100 and info.value.num_bytes > 200
        await asyncio.wait_for(queue.put(GenerateRequest("r", "x")), 1.0)  # a small one is queued
    finally:
        queue.close()
