"""Bad frames and invalid requests get an `ErrorReply`; the engine keeps serving everyone else.

A raw `DealerQueue` sends what `AsyncClient` never would. Every bad frame is
answered with kind "bad_frame" (request id None); every well-formed but
invalid request with kind "invalid_request" naming the field. Meanwhile a
second client streams a good request, which must come out right.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.engine import Engine
from asyncpp.launch import MAX_FRAME_BYTES
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_msgs import ErrorReply, GenerateRequest, RequestDelta, RequestDeltas
from asyncpp.wire.codec import encode
from asyncpp.wire.queues import DealerQueue
from asyncpp.wire.stage_msgs import Shutdown
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect, is_idle, poll_until

GOOD = SamplingParams(max_tokens=180, temperature=0.0, ignore_eos=True)
REPLY_TIMEOUT_S = 10.0


def frame(tag, fields) -> bytes:
    return msgpack.packb([tag, fields], use_bin_type=True)


BAD_FRAMES = [
    ("malformed bytes", b"\xc1\xc1 not msgpack", "malformed frame"),
    ("truncated", encode(GenerateRequest("t", "hello"))[:-2], "malformed frame"),
    ("not [tag, map]", msgpack.packb({"generate": {}}), "frame must be [type_tag, {fields}]"),
    ("unknown type", frame("launch_missiles", {}), "unknown message type 'launch_missiles'"),
    ("wrong type", frame("generate", {"request_id": 5, "prompt": "x"}), "GenerateRequest.request_id must be str"),
    ("wrong nested type", frame("generate", {"request_id": "w", "prompt": [1, "a"]}), "GenerateRequest.prompt"),
    ("unknown field", frame("abort", {"request_id": "r", "force": True}), "AbortRequest: unknown field 'force'"),
    ("missing field", frame("generate", {"prompt": "x"}), "request_id"),
    # str and bytes field names together used to raise TypeError and kill the engine's client loop.
    ("mixed key kinds", frame("abort", {"request_id": "r", b"x": 1, "y": 2}), "AbortRequest: unknown field"),
    ("engine-to-stage message", encode(Shutdown("from a client")), "unexpected message Shutdown"),
    ("engine-to-client message", encode(RequestDelta("r", "", [])), "unexpected message RequestDelta"),
    ("oversized", encode(GenerateRequest("big", "a" * (MAX_FRAME_BYTES + 1))), f"over the {MAX_FRAME_BYTES}-byte limit"),
]

INVALID_REQUESTS = [
    ("unknown key", "hello", {"max_tokens": 4, "beam_width": 2}, "sampling_params", "unknown sampling parameter"),
    ("temperature -1", "hello", {"temperature": -1}, "sampling_params", "temperature"),
    ("top_p 0", "hello", {"top_p": 0}, "sampling_params", "top_p"),
    ("max_tokens str", "hello", {"max_tokens": "x"}, "sampling_params", "max_tokens"),
    ("stop int", "hello", {"stop": 5}, "sampling_params", "sampling_params"),
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

        for name, payload, words in BAD_FRAMES:
            await dealer.put_raw(payload)
            msg = await reply(dealer)
            assert isinstance(msg, ErrorReply), (name, msg)
            assert (msg.kind, msg.request_id) == ("bad_frame", None), (name, msg)
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
