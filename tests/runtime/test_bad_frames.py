"""Bad frames and invalid requests get an `ErrorReply`; the engine keeps serving everyone else.

A raw `DealerQueue` sends what `AsyncClient` never would. Every bad frame is
answered with kind "bad_frame", naming the request when the frame's head is a
`generate` with a string id (else None); every well-formed but invalid request
with kind "invalid_request" naming the field. Meanwhile a
second client streams a good request, which must come out right.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.engine import Engine
from asyncpp.errors import InvalidRequestError
from asyncpp.config import ServerConfig
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_msgs import ErrorReply, GenerateRequest, RequestDelta, RequestDeltas
from asyncpp.wire.codec import encode
from asyncpp.wire.queues import DealerQueue
from asyncpp.wire.stage_msgs import Shutdown
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect, is_idle, poll_until

MAX_FRAME_BYTES = ServerConfig().max_frame_bytes  # the shared engine's
GOOD = SamplingParams(max_tokens=180, temperature=0.0, ignore_eos=True)
REPLY_TIMEOUT_S = 10.0


def frame(tag, fields) -> bytes:
    return msgpack.packb([tag, fields], use_bin_type=True)


BAD_FRAMES = [  # (name, frame, words in the error, the request id the reply names)
    ("malformed bytes", b"\xc1\xc1 not msgpack", "malformed frame", None),
    ("truncated", encode(GenerateRequest("t", "hello"))[:-2], "malformed frame", "t"),
    ("not [tag, map]", msgpack.packb({"generate": {}}), "frame must be [type_tag, {fields}]", None),
    ("unknown type", frame("launch_missiles", {}), "unknown message type 'launch_missiles'", None),
    ("wrong type", frame("generate", {"request_id": 5, "prompt": "x"}), "GenerateRequest.request_id must be str", None),
    ("wrong nested type", frame("generate", {"request_id": "w", "prompt": [1, "a"]}), "GenerateRequest.prompt", "w"),
    ("unknown field", frame("abort", {"request_id": "r", "force": True}), "AbortRequest: unknown field 'force'", None),
    ("missing field", frame("generate", {"prompt": "x"}), "request_id", None),
    # str and bytes field names together used to raise TypeError and kill the engine's client loop.
    ("mixed key kinds", frame("abort", {"request_id": "r", b"x": 1, "y": 2}), "AbortRequest: unknown field", None),
    ("engine-to-stage message", encode(Shutdown("from a client")), "unexpected message Shutdown", None),
    ("engine-to-client message", encode(RequestDelta("r", "", [])), "unexpected message RequestDelta", None),
    ("oversized", encode(GenerateRequest("big", "a" * (MAX_FRAME_BYTES + 1))), f"over the {MAX_FRAME_BYTES}-byte limit", "big"),
]

INVALID_REQUESTS = [
    ("unknown key", "hello", {"max_tokens": 4, "beam_width": 2}, "sampling_params", "unknown sampling parameter"),
    ("temperature -1", "hello", {"temperature": -1}, "temperature", "temperature must be >= 0"),
    ("temperature inf", "hello", {"temperature": float("inf")}, "temperature", "finite"),
    ("top_p 0", "hello", {"top_p": 0}, "top_p", "top_p"),
    ("max_tokens str", "hello", {"max_tokens": "x"}, "max_tokens", "max_tokens"),
    ("stop int", "hello", {"stop": 5}, "stop", "stop must be a string or a list"),
    ("empty prompt", "", {}, "prompt", "empty"),
    ("empty token list", [], {}, "prompt", "empty"),
    ("token outside vocab", [5, 320], {}, "prompt_token_ids", "outside the vocabulary"),
    ("negative token", [5, -1], {}, "prompt_token_ids", "outside the vocabulary"),
    ("too long", [5] * 300, {}, "prompt", "max_model_len"),
    ("chat without content", [{"role": "user"}], {}, "messages", "content"),
]


@pytest.fixture(scope="module")
def good_prompt():
    return tiny_prompts(320, 5)[4]  # 70 tokens: 70 + 180 fit max_model_len 256


@pytest.fixture(scope="module")
def expected(tiny_hf_dir, good_prompt):
    return Engine(tiny_config(tiny_hf_dir)).generate([good_prompt], GOOD)[0].token_ids


async def reply(dealer: DealerQueue):
    return await asyncio.wait_for(dealer.get(), REPLY_TIMEOUT_S)


async def test_bad_frames_and_invalid_requests_get_errors_while_others_are_served(
    shared_pp2_engine, good_prompt, expected
):
    client = AsyncClient(shared_pp2_engine.address)
    dealer = DealerQueue(shared_pp2_engine.address)
    try:
        await poll_until(client.stats, is_idle, 5)
        good = asyncio.create_task(collect(client, good_prompt, GOOD))
        await poll_until(client.stats, lambda s: s["num_running"] == 1, timeout_s=10)

        for name, payload, words, request_id in BAD_FRAMES:
            await dealer.put_raw(payload)
            msg = await reply(dealer)
            assert isinstance(msg, ErrorReply), (name, msg)
            assert (msg.kind, msg.request_id) == ("bad_frame", request_id), (name, msg)
            assert words in msg.message, (name, msg.message)

        # More than one frame in a message is a bad frame too.
        dealer._sock.send_multipart([b"part one", b"part two"])
        msg = await reply(dealer)
        assert msg.kind == "bad_frame" and "one frame per message" in msg.message

        for i, (name, prompt, params, field, words) in enumerate(INVALID_REQUESTS):
            await dealer.put(GenerateRequest(f"bad-{i}", prompt, params))
            msg = await reply(dealer)
            assert isinstance(msg, ErrorReply), (name, msg)
            assert (msg.kind, msg.request_id, msg.field) == ("invalid_request", f"bad-{i}", field), (name, msg)
            assert words in msg.message, (name, msg.message)

        assert await client.health()
        tokens, _, reason = await asyncio.wait_for(good, timeout=30)
        assert tokens == expected and reason == "length"

        # The client that sent all that garbage is still served normally.
        await dealer.put(GenerateRequest("fine", good_prompt, GOOD.to_dict()))
        tokens, finished = [], False
        while not finished:
            msg = await reply(dealer)
            assert isinstance(msg, RequestDeltas) and msg.request_ids == ["fine"], msg  # its only request
            (delta,) = msg.deltas()
            assert delta.request_id == "fine", delta
            tokens += delta.token_ids
            finished = delta.finished
        assert tokens == expected
        stats = await poll_until(client.stats, is_idle, 5)
        assert not stats["is_dead"]
        assert await client.health()
    finally:
        dealer.close()
        client.close()


async def test_an_oversized_request_fails_its_own_generate_call(shared_pp2_engine, good_prompt, expected):
    """Over the engine's frame limit: a client that knows the limit refuses to send it, naming the
    largest field; one that does not sends it, and the engine's bad_frame reply names the request,
    so its `generate` fails instead of waiting forever. Then the same client is served normally."""
    huge = {"max_tokens": 2, "stop": ["x" * MAX_FRAME_BYTES]}
    knowing = AsyncClient(shared_pp2_engine.address, max_frame_bytes=MAX_FRAME_BYTES)
    unknowing = AsyncClient(shared_pp2_engine.address)
    try:
        with pytest.raises(InvalidRequestError, match=f"over the {MAX_FRAME_BYTES}-byte limit") as info:
            await anext(knowing.generate(good_prompt, huge))
        assert info.value.field == "stop"
        with pytest.raises(InvalidRequestError, match=f"over the {MAX_FRAME_BYTES}-byte limit") as info:
            await asyncio.wait_for(anext(unknowing.generate(good_prompt, huge, request_id="huge")), REPLY_TIMEOUT_S)
        assert info.value.field == "request"
        for client in (knowing, unknowing):
            assert client._streams == {} and not client.unrouted_errors
            tokens, _, reason = await asyncio.wait_for(collect(client, good_prompt, GOOD), timeout=30)
            assert tokens == expected and reason == "length"
        assert not (await poll_until(knowing.stats, is_idle, 5))["is_dead"]
    finally:
        knowing.close()
        unknowing.close()
