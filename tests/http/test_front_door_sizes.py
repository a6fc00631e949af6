"""The HTTP front door against bodies and prompts too big: refused by their size, holding up no one.

The same small launched engine as `test_front_door` (its `server` fixture,
the session's `front_door_server`): every case ends by checking that the next normal
request is answered and that nothing is held.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncpp.client import AsyncClient
from asyncpp.engine.input_processor import InputProcessor
from asyncpp.errors import InvalidRequestError
from asyncpp.http.app import MIN_MAX_BODY_BYTES, HttpSettings, build_app
from asyncpp.http.front_door import OFF_LOOP_BODY_BYTES
from asyncpp.sampling.params import MAX_STOP_STRINGS
from asyncpp.tokenizer import load_tokenizer
from tests.http.test_front_door import (  # noqa: F401  (server: the session's front-door engine)
    DEADLINE_S, JSON, LONGEST, MAX_FRAME_BYTES, MODEL, PROMPT, error_of, served_and_nothing_held, server,
)
# ---- 1. a prompt too big for max_model_len or for a frame --------------------------------------
async def test_a_16_mb_prompt_is_a_400_before_anything_is_sent(server):
    body = json.dumps({"prompt": "hello world " * 1_400_000, "max_tokens": 4})  # ~16.8 MB
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
        error = error_of(await http.post("/v1/completions", content=body, headers=JSON), 400)
        assert error["param"] == "prompt" and "longer than max_model_len" in error["message"]
        chat = json.dumps({"messages": [{"role": "user", "content": "hello world " * 1_400_000}], "max_tokens": 4})
        error = error_of(await http.post("/v1/chat/completions", content=chat, headers=JSON), 400)
        assert error["param"] == "messages" and "longer than max_model_len" in error["message"]
    await served_and_nothing_held(server)


async def test_a_request_over_the_frame_limit_is_a_400_naming_its_largest_field(server):
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["x" * (MAX_FRAME_BYTES + 1)]}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
        error = error_of(await http.post("/v1/completions", json=body), 400)
    assert error["param"] == "stop" and f"over the {MAX_FRAME_BYTES}-byte limit" in error["message"]
    await served_and_nothing_held(server)


async def test_an_engine_error_about_a_frame_reaches_the_request_that_sent_it(server):
    """A client that does not know the limit sends the frame; the engine's bad_frame reply names the
    request, so its `generate` fails at once instead of waiting forever."""
    client = AsyncClient(server.address)  # no max_frame_bytes: only ZMQ's hard limit is checked here
    try:
        with pytest.raises(InvalidRequestError, match=f"over the {MAX_FRAME_BYTES}-byte limit"):
            gen = client.generate([5] * 10, {"max_tokens": 2, "stop": ["y" * MAX_FRAME_BYTES]})
            await asyncio.wait_for(anext(gen), DEADLINE_S)
        assert client._streams == {}
    finally:
        client.close()
    await served_and_nothing_held(server)



async def test_a_body_of_a_million_empty_messages_holds_up_no_one(server):
    """A body just under the limit with 1,000,000 `{"role": "user", "content": ""}` messages: far more
    messages than max_model_len tokens can hold, refused by their number before the chat template runs;
    meanwhile a running stream keeps its pace and /health answers at once."""
    messages = [{"role": "user", "content": ""}] * 1_000_000
    body = json.dumps({"messages": messages, "max_tokens": 4}, separators=(",", ":")).encode()
    assert len(body) <= MIN_MAX_BODY_BYTES
    clock = asyncio.get_running_loop().time
    stop = asyncio.Event()
    gaps: list[tuple[float, float]] = []  # (from, to): between two chunks of one stream
    polls: list[tuple[float, float]] = []  # (sent, answered): one /health each
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:

        async def keep_streaming(streaming: asyncio.Event) -> None:  # one stream after another, until stop
            while not stop.is_set():
                async with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, **LONGEST, "stream": True}) as r:
                    last = None
                    async for _ in r.aiter_lines():
                        if last is not None:
                            gaps.append((last, clock()))
                        last = clock()
                        streaming.set()
                        if stop.is_set():
                            return

        async def poll_health() -> None:
            while not stop.is_set():
                sent = clock()
                assert (await http.get("/health")).status_code == 200
                polls.append((sent, clock()))
                await asyncio.sleep(0.05)

        streaming = asyncio.Event()
        tasks = [asyncio.create_task(keep_streaming(streaming)), asyncio.create_task(poll_health())]
        await asyncio.wait_for(streaming.wait(), DEADLINE_S)
        start = clock()
        r = await http.post("/v1/chat/completions", content=body, headers=JSON)
        end = clock()
        await asyncio.sleep(1.0)  # what the server does after answering (freeing the body) counts too
        stop.set()
        await asyncio.gather(*tasks)
    error = error_of(r, 400)
    assert error["param"] == "messages" and "max_model_len" in error["message"], error
    in_window = lambda spans: [b - a for a, b in spans if b >= start and a <= end + 1.0]  # noqa: E731
    stream_gaps_s, health_s = in_window(gaps), in_window(polls)
    print(f"refused after {end - start:.2f} s; largest stream gap {max(stream_gaps_s):.3f} s of {len(stream_gaps_s)}; "
          f"slowest /health {max(health_s):.3f} s of {len(health_s)}")
    assert len(stream_gaps_s) > 5 and len(health_s) > 2  # both went on while the body was read and refused
    assert max(stream_gaps_s) < 1.0 and max(health_s) < 1.0
    await served_and_nothing_held(server)


async def test_a_body_over_the_limit_is_a_413_unread(server, tiny_hf_dir):
    """Bodies are read up to max(32 MiB, 4 x max_frame_bytes); the app in process, as above."""
    tokenizer = load_tokenizer("hf", str(tiny_hf_dir), 320)
    settings = HttpSettings(server.address, MODEL, 256, max_frame_bytes=MAX_FRAME_BYTES)
    app = build_app(settings, InputProcessor(tokenizer, 320, 256))
    body = json.dumps({"prompt": "x" * MIN_MAX_BODY_BYTES}).encode()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            error = error_of(await http.post("/v1/completions", content=body, headers=JSON), 413)
            assert f"over the {MIN_MAX_BODY_BYTES}-byte limit" in error["message"]
    await served_and_nothing_held(server)


async def test_a_big_body_is_refused_by_its_size_before_it_is_validated(server, tiny_hf_dir):
    """Over OFF_LOOP_BODY_BYTES, what cannot fit max_model_len whatever its details is refused before
    the validation that would name the bad item at the end; a small body is validated first, as ever."""
    tokenizer = load_tokenizer("hf", str(tiny_hf_dir), 320)
    app = build_app(HttpSettings(server.address, MODEL, 256), InputProcessor(tokenizer, 320, 256))
    robot = {"role": "robot", "content": ""}  # not a role: validation names it
    cases = [  # (path, body, big: refused by size, else validated first)
        ("/v1/chat/completions", {"messages": [{"role": "developer", "content": ""}] * 20_000 + [robot]}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 300 + [robot]}, False),
        ("/v1/completions", {"prompt": [7] * 100_000 + ["x"]}, True),
        ("/v1/completions", {"prompt": ["x"] * 100_000 + [7]}, True),
        ("/v1/completions", {"prompt": [7] * 300 + ["x"]}, False),  # (300 tokens would not fit either)
        # Lists bounded by their lengths: stop strings, stop token ids (vocabulary 320), content parts.
        ("/v1/completions", {"prompt": "x", "stop": ["x"] * 100_000 + [7]}, True),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [7] * 100_000 + ["x"]}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 30_000 + [7]}]}, True),
    ]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            for path, body, big in cases:
                content = json.dumps(body).encode()
                assert (len(content) > OFF_LOOP_BODY_BYTES) == big
                error = error_of(await http.post(path, content=content, headers=JSON), 400)
                param = "messages" if path == "/v1/chat/completions" else next(iter({"stop", "stop_token_ids"} & body.keys()), "prompt")
                assert error["param"] == param, error
                if param in ("stop", "stop_token_ids"):
                    assert error["message"] in (f"stop must hold at most {MAX_STOP_STRINGS} strings, got 100001",
                                                "stop_token_ids must hold at most 320 entries (the vocabulary's size), got 100001"), error  # fmt: skip
                elif param == "messages" and isinstance(body["messages"][0]["content"], list):
                    assert error["message"] == "30001 content parts, more than max_model_len 256 can hold", error
                elif not big:  # the validation's word on the bad item, as before
                    assert error["message"].startswith(f"{param}.") and "max_model_len" not in error["message"], error
                elif param == "messages":
                    assert error["message"].startswith("messages (20001) are more than max_model_len 256"), error
                elif body["prompt"][0] == 7:
                    assert error["message"] == "prompt has 100001 tokens, longer than max_model_len 256", error
                else:
                    assert error["message"] == "one prompt per request is supported, got 100001", error
    await served_and_nothing_held(server)
