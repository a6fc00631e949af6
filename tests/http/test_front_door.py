"""The HTTP front door under hostile and careless clients: never a hang, never a 5xx, nothing held.

One launched engine (tiny model, pp=1) with the HTTP server serves the whole
module and `test_front_door_sizes` (`front_door_server`), configured small so that its limits are reached cheaply: two
requests run at once and two more may wait (`max_num_seqs` 2,
`max_queued_requests` 2), and the engine reads frames of at most 64 KiB.
Every case ends by checking that the next normal request is answered right
and that nothing is held: no request running or waiting, no KV block in use.

Where a case needs requests to stay in flight while it acts (overload,
disconnects), the stage processes are frozen (SIGSTOP) meanwhile: the engine
still takes requests, aborts and stats, but no step completes, so nothing
depends on how fast this machine runs the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncpp.client import AsyncClient
from asyncpp.engine.input_processor import InputProcessor
from asyncpp.http.app import HttpSettings, build_app
from asyncpp.tokenizer import load_tokenizer
from tests.http.test_openai_server import metric_values
from tests.runtime.conftest import poll_until

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. "
JSON = {"content-type": "application/json"}
MAX_FRAME_BYTES = 64 * 1024
MAX_NUM_SEQS, MAX_QUEUED = 2, 2
LONG = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}  # far more steps than a case takes to act
# The disconnect case needs two requests still generating once a third has its first token: as
# many steps as the context allows (the tiny model's 512 positions, less PROMPT's 46 bytes).
LONGEST = {**LONG, "max_tokens": 450}
DEADLINE_S = 30.0  # liveness only: how long a case waits for what must happen before it fails
# Per endpoint. CI runs the same 150 bodies every time; ASYNCPP_FUZZ_EXAMPLES=N runs N new random ones.
FUZZ_EXAMPLES = int(os.environ.get("ASYNCPP_FUZZ_EXAMPLES", 150))


@pytest.fixture(scope="module")
def server(front_door_server):
    """The session's front-door engine (`tests/http/conftest.py`), under this module's name for it."""
    return front_door_server


@pytest.fixture(scope="module")
def expected_text(server) -> str:
    """The greedy answer to PROMPT under LONG, from the engine's native client."""

    async def native() -> str:
        client = AsyncClient(server.address)
        try:
            return "".join([d.text async for d in client.generate(PROMPT, dict(LONG))])
        finally:
            client.close()

    return asyncio.run(native())


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of a response with this status."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    return error


async def served_and_nothing_held(server) -> None:
    """The next normal request gets its answer, then /metrics shows no request and no KV block held."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
        r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text

        async def scrape() -> dict[str, float]:
            return metric_values((await http.get("/metrics")).text)

        idle = lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0  # noqa: E731
        values = await poll_until(scrape, lambda m: idle(m) and m["vllm:kv_cache_usage_perc"] == 0, DEADLINE_S)
        assert values["vllm:kv_cache_usage_perc"] == 0


@contextlib.asynccontextmanager
async def stages_frozen(server):
    """No step completes inside (the stage processes are stopped); requests stay where they are."""
    client = AsyncClient(server.address)
    try:
        pids = (await client.stats())["stage_pids"]
    finally:
        client.close()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def wait_in_flight(server, num_requests: int) -> None:
    client = AsyncClient(server.address)
    try:
        await poll_until(client.stats, lambda s: s["num_running"] + s["num_waiting"] == num_requests, DEADLINE_S)
    finally:
        client.close()


def engine_events(log_file: Path, prefix: str) -> dict[str, list[str]]:
    """request id -> its events in the engine's log, for request ids starting with `prefix`."""
    events: dict[str, list[str]] = {}
    for line in log_file.read_text().splitlines():
        if f'"request_id": "{prefix}' not in line:
            continue
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            events.setdefault(record["request_id"], []).append(record["event"])
    return events


# ---- 2. a client that hangs up, streamed or not, waiting or running ---------------------------
async def test_every_disconnect_aborts_its_request(server):
    """Four clients hang up: one non-streamed and one streamed request generating, one of each waiting."""
    before = set(engine_events(server.log_file, "cmpl-"))
    streaming = asyncio.Event()

    async def hang_up_later(stream: bool) -> None:
        body = {"prompt": PROMPT, **LONGEST, "stream": stream}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
            if not stream:
                await http.post("/v1/completions", json=body)
                return
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    streaming.set()

    # Both start together: the non-streamed one is still generating when the streamed one has its
    # first token (hundreds of steps remain), and then nothing moves until they hang up.
    running = [asyncio.create_task(hang_up_later(False)), asyncio.create_task(hang_up_later(True))]
    await asyncio.wait_for(streaming.wait(), DEADLINE_S)
    async with stages_frozen(server):  # both have tokens, and far from all of them
        waiting = [asyncio.create_task(hang_up_later(stream)) for stream in (False, True)]
        await wait_in_flight(server, 4)
        for task in running + waiting:
            task.cancel()  # closes its connection: the server sees its client go
        await asyncio.gather(*running, *waiting, return_exceptions=True)

        async def aborted() -> dict[str, list[str]]:
            return {rid: ev for rid, ev in engine_events(server.log_file, "cmpl-").items() if rid not in before}

        events = await poll_until(aborted, lambda e: len(e) == 4 and all("request_aborted" in v for v in e.values()),
                                  DEADLINE_S)  # fmt: skip
    assert not any("request_finished" in v for v in events.values()), events
    await served_and_nothing_held(server)


# ---- 3. and 4. malformed input: OpenAI-shaped 4xx naming the field ----------------------------
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = ("/v1/chat/completions", {"messages": MESSAGES})
COMPLETIONS = ("/v1/completions", {"prompt": "hi"})
MALFORMED = [  # (name, path, body bytes, headers, status, param, words)
    ("max_tokens 2**70", "/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, None, 400, "max_tokens", "less than"),
    ("seed 2**70", "/v1/completions", {"prompt": "hi", "seed": 2**70}, None, 400, "seed", "less than"),
    ("token id 2**70", "/v1/completions", {"prompt": [1, 2**70]}, None, 400, "prompt", "prompt"),
    ("lone surrogate", "/v1/completions", {"prompt": "a\ud800b"}, None, 400, "prompt", "surrogate"),
    ("lone surrogate in chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udc00"}]},
     None, 400, "messages", "surrogate"),  # fmt: skip
    ("lone surrogate in stop", "/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, None, 400, "stop", "surrogate"),
    ("nested 100000 deep", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, 400, None,
     "nested too deeply"),  # fmt: skip
    ("temperature Infinity", "/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', None, 400, "temperature",
     "finite"),  # fmt: skip
    ("top_p NaN", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', None, 400,
     "top_p", "finite"),  # fmt: skip
    ("temperature 1e309", "/v1/completions", b'{"prompt": "hi", "temperature": 1e309}', None, 400, "temperature",
     "finite"),  # fmt: skip
    ('temperature "0.5"', "/v1/completions", {"prompt": "hi", "temperature": "0.5"}, None, 400, "temperature", "number"),
    ("text/plain", "/v1/completions", {"prompt": "hi"}, {"content-type": "text/plain"}, 415, None, "application/json"),
    ("a form", "/v1/chat/completions", {"messages": MESSAGES}, {"content-type": "application/x-www-form-urlencoded"},
     415, None, "application/json"),  # fmt: skip
    ("no content type", "/v1/completions", {"prompt": "hi"}, {"content-type": ""}, 415, None, "application/json"),
    ("engine's check, named", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens",
     "max_tokens must be >= 1"),  # fmt: skip
    ("engine's check, chat's name", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
     None, 400, "top_logprobs", "top_logprobs must be in [0, 20]"),  # fmt: skip
    ("repetition_penalty 1e-300", "/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-300}, None, 400,
     "repetition_penalty", "repetition_penalty must be in"),  # fmt: skip
    *[(f"{field} {json.dumps(value)} ({path[4:]})", path, {**base, **extra, field: value}, None, 400, field,
       "not supported") for (path, base), extra, field, value in [
        (CHAT, {}, "functions", [{"name": "f"}]),
        (CHAT, {}, "function_call", {"name": "f"}),
        (CHAT, {}, "logit_bias", {"5": 10}),
        (COMPLETIONS, {}, "logit_bias", {"5": -100}),
        (COMPLETIONS, {}, "suffix", "!"),
        (COMPLETIONS, {}, "best_of", 3),
        (COMPLETIONS, {}, "best_of", True),
        (CHAT, {}, "audio", {"voice": "alloy", "format": "wav"}),
        (CHAT, {}, "modalities", ["text", "audio"]),
        (CHAT, {}, "prediction", {"type": "content", "content": "hi"}),
        (CHAT, {}, "web_search_options", {}),
        (CHAT, {"stream": True}, "stream_options", {"include_obfuscation": True}),
    ]],  # fmt: skip
    ('stream_options include_usage "yes"', "/v1/chat/completions",
     {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": "yes"}}, None, 400, "stream_options",
     "valid boolean"),  # fmt: skip
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     None, 400, "stream_options", "only allowed when stream is true"),  # fmt: skip
    ("stream_options with stream false", "/v1/chat/completions",
     {"messages": MESSAGES, "stream": False, "stream_options": {"include_usage": False}}, None, 400, "stream_options",
     "only allowed when stream is true"),  # fmt: skip
    ("stream_options unknown", "/v1/completions",
     {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}, None, 400, "stream_options",
     "not permitted"),  # fmt: skip
    *[(f"{name} ({path[4:]})", path, {**base, **extra}, None, 400, param, words)
      for name, (path, base), extra, param, words in [
        ("tool_choice required, no tools", CHAT, {"tool_choice": "required"}, "tool_choice", "needs tools"),
        ("a tool's bad name", CHAT, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
         "must be 1-64"),
        ("a tool that is not a function", CHAT, {"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be"),
        ("tool_choice naming no tool", CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
         "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in tools"),
        ("a named tool's schema that does not compile", CHAT, {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "nope"}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[0].function.parameters", "does not compile"),
        ("response_format xml", COMPLETIONS, {"response_format": {"type": "xml"}}, "response_format.type", "must be"),
        ("a response_format schema that does not compile", CHAT, {"response_format": {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format.json_schema.schema", "does not compile"),
        ("a regex that does not compile", COMPLETIONS, {"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex",
         "does not compile"),
        ("structured_outputs and response_format", CHAT, {"structured_outputs": {"regex": "a"},
         "response_format": {"type": "json_object"}}, "structured_outputs", "send one"),
    ]],  # fmt: skip
    ('parallel_tool_calls "yes"', "/v1/chat/completions", {"messages": MESSAGES, "parallel_tool_calls": "yes"}, None, 400,
     "parallel_tool_calls", "valid boolean"),  # fmt: skip
]


@pytest.mark.parametrize("name,path,body,headers,status,param,words", MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_malformed_input_is_an_openai_4xx_naming_the_field(server, name, path, body, headers, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
        r = await http.post(path, content=content, headers={**JSON, **(headers or {})})
    error = error_of(r, status)
    assert error["param"] == param and words in error["message"], error
    assert error["message"].count(f"{param}: {param}") == 0  # a field is named once
    await served_and_nothing_held(server)


ASKS_NOTHING = [  # OpenAI's fields asyncpp does not implement, at values that ask for nothing (vLLM takes them too)
    (CHAT, {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "functions": [], "function_call": "none",
            "response_format": {"type": "text"}, "logit_bias": {}, "modalities": ["text"], "audio": None,
            "prediction": None, "web_search_options": None, "stream_options": None}),
    (CHAT, {"tool_choice": "auto", "function_call": "auto", "logit_bias": None, "response_format": None}),
    (COMPLETIONS, {"suffix": None, "best_of": 1, "logit_bias": {}, "response_format": {"type": "text"},
                   "stream_options": None}),
    (COMPLETIONS, {"suffix": "", "best_of": None, "stream": True,
                   "stream_options": {"include_usage": True, "include_obfuscation": False}}),
    (CHAT, {"not_an_openai_field": {"anything": [1]}, "stream": False}),  # ignored, as OpenAI's server does
]  # fmt: skip


@pytest.mark.parametrize("endpoint,fields", ASKS_NOTHING, ids=[f"{e[0][4:]} {sorted(f)}"[:80] for e, f in ASKS_NOTHING])
async def test_openai_fields_at_values_that_ask_for_nothing_are_served(server, endpoint, fields):
    path, base = endpoint
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
        r = await http.post(path, json={**base, **fields, "max_tokens": 2})
    check_answer(r)
    assert r.status_code == 200, r.text
    if fields.get("stream"):
        assert '"usage"' in r.text  # include_usage: a last chunk with the usage
    await served_and_nothing_held(server)


async def test_unknown_paths_and_methods_are_openai_errors(server):
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
        assert error_of(await http.get("/v1/nothing"), 404)["type"] == "NotFoundError"
        r = await http.get("/v1/completions")
        assert error_of(r, 405)["type"] == "MethodNotAllowedError" and "POST" in r.headers["allow"]
    await served_and_nothing_held(server)


# ---- the bound: 503 + Retry-After at once beyond it, the admitted ones exact -------------------
async def test_beyond_the_bound_requests_get_503_at_once_and_the_admitted_finish_exactly(server, expected_text):
    bound = MAX_NUM_SEQS + MAX_QUEUED

    async def admitted() -> str:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S * 4) as http:
            r = await http.post("/v1/completions", json={"prompt": PROMPT, **LONG})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    async with stages_frozen(server):  # the admitted ones cannot finish meanwhile
        tasks = [asyncio.create_task(admitted()) for _ in range(bound)]
        await wait_in_flight(server, bound)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as http:
            extra = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": PROMPT, **LONG}) for _ in range(6)))
            stream = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    for r in [*extra, stream]:
        error = error_of(r, 503)
        assert error["code"] == "overloaded" and r.headers["retry-after"] == "1"
    assert await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S * 4) == [expected_text] * bound
    await served_and_nothing_held(server)


# ---- property: random JSON for every field, random bodies: 200 or an OpenAI 4xx, never a 5xx ---
NASTY_TEXT = st.sampled_from(["", "a\ud800b", "\udfff", "\x00", "\ufffd", "hi " * 200, "<|im_start|>", "{{ x }}"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | NASTY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SMALL_VALID = {  # plausible values, so that fuzzed bodies also reach the engine and get answered
    "max_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "user": st.text(max_size=8),
    "model": st.just(MODEL),
}
COMPLETION_FIELDS = {**SMALL_VALID, "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 319), min_size=1,
                     max_size=20), "logprobs": st.integers(0, 5), "echo": st.just(False)}  # fmt: skip
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.text(max_size=40)})  # fmt: skip
CHAT_FIELDS = {**SMALL_VALID, "messages": st.lists(MESSAGE, min_size=1, max_size=3), "logprobs": st.booleans(),
               "top_logprobs": st.integers(0, 5), "max_completion_tokens": st.integers(1, 3)}  # fmt: skip


def bodies(fields: dict, required: dict) -> st.SearchStrategy[bytes]:
    """A JSON object whose fields are plausible or random JSON, or now and then any bytes at all."""
    value = {name: strategy | JSON_VALUES for name, strategy in fields.items()}
    optional = {k: v for k, v in value.items() if k not in required}
    objects = st.fixed_dictionaries({k: value[k] for k in required}, optional=optional)
    return objects.map(lambda body: json.dumps({"max_tokens": 2, **body}).encode()) | st.binary(max_size=64)


CONTENT_TYPES = st.sampled_from(["application/json"] * 6 + ["application/json; charset=utf-8", "text/plain", ""])


def check_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        error_of(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


@pytest.mark.parametrize("path,fields,required", [
    ("/v1/completions", COMPLETION_FIELDS, {"prompt"}),
    ("/v1/chat/completions", CHAT_FIELDS, {"messages"}),
])  # fmt: skip
def test_fuzzed_bodies_get_a_200_or_an_openai_4xx(server, path, fields, required):
    with httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="ASYNCPP_FUZZ_EXAMPLES" not in os.environ,
                  database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
        @given(body=bodies(fields, required), content_type=CONTENT_TYPES)
        def one(body: bytes, content_type: str) -> None:
            check_answer(http.post(path, content=body, headers={"content-type": content_type}))

        one()
    asyncio.run(served_and_nothing_held(server))


# ---- the key guards everything but /health, and /metrics unless metrics_require_key ----------
@pytest.mark.parametrize("metrics_require_key", [False, True])
async def test_the_key_guards_every_path_but_health_and_maybe_metrics(server, tiny_hf_dir, metrics_require_key):
    """The app in process (its lifespan run by hand) against this module's engine."""
    tokenizer = load_tokenizer("hf", str(tiny_hf_dir), 320)
    settings = HttpSettings(server.address, MODEL, 256, "s3cret", metrics_require_key=metrics_require_key)
    app = build_app(settings, InputProcessor(tokenizer, 320, 256))
    key = {"Authorization": "Bearer s3cret"}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            for path in ("/docs", "/openapi.json", "/redoc", "/v1/models", "/v1/nothing"):
                assert error_of(await http.get(path), 401)["code"] == "invalid_api_key", path
            assert error_of(await http.post("/v1/completions", json={"prompt": "hi"}), 401)["code"] == "invalid_api_key"
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/metrics")).status_code == (401 if metrics_require_key else 200)
            assert (await http.get("/openapi.json", headers=key)).json()["info"]["title"] == "asyncpp"
            assert (await http.get("/docs", headers=key)).status_code == 200
            assert (await http.get("/metrics", headers=key)).status_code == 200
            assert error_of(await http.get("/v1/nothing", headers=key), 404)["type"] == "NotFoundError"
            r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=key)
            assert r.json()["usage"]["completion_tokens"] == 2
    await served_and_nothing_held(server)
