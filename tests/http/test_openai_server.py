"""The OpenAI-compatible HTTP server, driven by the official `openai` client and by raw HTTP.

One launched engine (tiny model, pp=2) with the HTTP server serves the whole
module (the session's `openai_server`, which the bench's `--base-url` test shares); the greedy outputs are checked against the native `AsyncClient` on
the same engine.
"""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from tests.runtime.conftest import poll_until
from tests.runtime.harness import launched, tiny_sections

openai = pytest.importorskip("openai")

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. "
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(openai_server):
    """The session's OpenAI-server engine (`tests/http/conftest.py`), under this module's name for it."""
    return openai_server


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


async def native(server, prompt, **params) -> tuple[str, list[int]]:
    client = AsyncClient(server.address)
    try:
        text, ids = "", []
        async for d in client.generate(prompt, SamplingParams(**params)):
            text += d.text
            ids += d.token_ids
        return text, ids
    finally:
        client.close()


async def native_prompt_ids(server, prompt: str) -> list[int]:
    """The prompt's token ids as the engine sees them (its byte-level tokenizer)."""
    from asyncpp.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("hf", str(server.model_dir), 320)
    return tokenizer.encode(prompt)


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.get("le"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def test_completion_greedy_equals_native_client(server, oai):
    expected, ids = await native(server, PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True)
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens > 0
    # Token ids as the prompt: the same answer.
    prompt_ids = (await native_prompt_ids(server, PROMPT))
    by_ids = oai.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected and by_ids.usage.prompt_tokens == len(prompt_ids) == out.usage.prompt_tokens
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []


async def test_chat_greedy_equals_native_client_streaming_and_not(server, oai):
    expected, _ = await native(server, MESSAGES, max_tokens=24, temperature=0.0, ignore_eos=True)
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 24
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=24, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 24


async def test_stop_string_ends_the_answer(server, oai):
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() and text[i:i+2] not in text[:i])
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]


async def test_logprobs(server, oai):
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                 extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and len(top) == 3 and max(top.values()) == pytest.approx(token_lp)  # greedy: the top one
        assert top[token] == pytest.approx(token_lp)
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    for c in content:  # the token's text, or its bytes spelled out when they are not UTF-8 alone
        raw = bytes(c.bytes)
        try:
            expected = raw.decode()
        except UnicodeDecodeError:
            expected = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        assert c.token == expected


async def test_seeded_sampling_is_reproducible(server, oai):
    def sample(seed):
        return oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                      extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


@pytest.mark.parametrize(
    "body,status,words",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'["a list"]', 400, "JSON object"),
        (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"prompt": 5}', 400, "prompt"),
        (b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens must be >= 1"),
        (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
        (b'{"prompt": "' + b"word " * 300 + b'", "max_tokens": 4}', 400, "longer than max_model_len"),
        (b'{"prompt": "hi", "model": "gpt-4"}', 404, "does not exist"),
        (b'{"prompt": "hi", "n": 2}', 400, "n = 1"),
        (b'{"prompt": ["a", "b"]}', 400, "one prompt per request"),
    ],
)
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, words):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert words in error["message"] and error["type"]
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_chat_errors(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and "role" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2})
        assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


async def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    client = AsyncClient(server.address)
    try:
        before = await client.stats()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # one chunk, then hang up
        stats = await poll_until(client.stats, lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, 10)
        assert stats["num_free_kv_blocks"] == before["num_free_kv_blocks"]
        with httpx.Client(base_url=server.base_url) as http:
            text = http.get("/metrics").text
            values = metric_values(text)
        assert values["vllm:num_requests_running"] == 0
        assert 'vllm:request_success_total{finished_reason="abort"' in text  # the client left: an abort
        assert values.get("asyncpp:request_failure_total", 0) == 0  # not a failure
        assert values["vllm:kv_cache_usage_perc"] == pytest.approx(1 - stats["num_free_kv_blocks"] / stats["num_kv_blocks"])
    finally:
        client.close()


def test_metrics_parse_and_counters_move(server, oai):
    with httpx.Client(base_url=server.base_url) as http:
        before = metric_values(http.get("/metrics").text)
        out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
        after = metric_values(http.get("/metrics").text)
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 7
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == out.usage.prompt_tokens
    assert after["vllm:e2e_request_latency_seconds_count"] == before.get("vllm:e2e_request_latency_seconds_count", 0) + 1
    assert after["vllm:time_to_first_token_seconds_count"] > before.get("vllm:time_to_first_token_seconds_count", 0)
    assert after["vllm:request_success_total"] > before.get("vllm:request_success_total", 0)


def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_api_key_required_when_set(tmp_path, tiny_hf_dir):
    port = free_port()
    sections = tiny_sections(tiny_hf_dir, 1, server={"http_port": port})
    with launched(tmp_path, sections, "--api-key", "s3cret"):
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret")
        assert good.completions.create(model=good.models.list().data[0].id, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        chunks = list(good.completions.create(model=good.models.list().data[0].id, prompt="hi", max_tokens=3, stream=True))
        assert sum(len(c.choices) for c in chunks) == 3  # a stream passes the key check chunk by chunk
        assert httpx.get(f"{base}/health").status_code == 200  # no key needed
        assert httpx.get(f"{base}/metrics").status_code == 200  # nor here, unless server.metrics_require_key
        assert httpx.get(f"{base}/openapi.json").status_code == 401  # everything else needs it
        assert httpx.get(f"{base}/openapi.json", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_non_loopback_http_without_a_key_is_refused_at_start_up(tmp_path, tiny_hf_dir):
    import subprocess
    import sys

    from asyncpp.bench.runs import to_toml

    config = tmp_path / "open.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir, 1, server={"http_port": free_port(), "http_host": "0.0.0.0"})))
    # Refused before any stage starts; the timeout is a liveness bound, not a speed limit.
    done = subprocess.run([sys.executable, "-m", "asyncpp.launch", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "server.api_key" in done.stderr, done.stderr
