"""Requests through any OpenAI-compatible server: asyncpp's HTTP front end, vLLM, llama.cpp's server.

Streaming (server-sent events) with `stream_options.include_usage`: each
chunk with text counts as one token for TTFT and ITL, as in `vllm bench
serve`; the final usage chunk sets the exact output-token count (the
difference goes to the last chunk). Chat prompts go to
`/v1/chat/completions`, text to `/v1/completions`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from asyncpp.bench.datasets import BenchRequest
from asyncpp.bench.metrics import RequestRecord, TokenTimer


class OpenAIBackend:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None  # made on first use, inside the running loop
        self.model = model

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # aiohttp, as `vllm bench serve` uses: its SSE reading costs the client a fraction of httpx's
            # per token, CPU that would otherwise be taken from the stages on a small machine.
            self._session = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def resolve_model(self) -> str:
        if self.model is None:
            async with self.http.get(f"{self.base_url}/models") as r:
                r.raise_for_status()
                self.model = (await r.json())["data"][0]["id"]
        return self.model

    async def send(self, request: BenchRequest, params: dict[str, Any]) -> RequestRecord:
        model = await self.resolve_model()
        is_chat = isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], dict)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": params["max_tokens"],
            "temperature": params.get("temperature", 0.0),
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": params.get("ignore_eos", False),  # vLLM, SGLang and asyncpp read it; others ignore it
        }
        if "structured_outputs" in params:  # vLLM's name: vLLM, SGLang (as extra body) and asyncpp read it
            body["structured_outputs"] = params["structured_outputs"]
        body["messages" if is_chat else "prompt"] = request.prompt
        url = f"{self.base_url}/{'chat/completions' if is_chat else 'completions'}"
        record = RequestRecord(expected_output_len=request.output_len, sent_at=time.monotonic())
        timer = TokenTimer(record)
        finish_reason = None
        try:
            async with self.http.post(url, json=body) as r:
                if r.status != 200:
                    text = await r.text()
                    record.error = f"HTTP {r.status}: {text[:200]}"
                    return record
                async for raw in r.content:
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = str(chunk["error"].get("message"))
                        return record
                    now = time.monotonic()
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") if not is_chat else (choice.get("delta") or {}).get("content")
                        if text:
                            timer.on_delta(now, 1, 0)
                        finish_reason = choice.get("finish_reason") or finish_reason
                    usage = chunk.get("usage")
                    if usage:
                        record.prompt_len = usage.get("prompt_tokens", record.prompt_len)
                        record.num_output_tokens = max(record.num_output_tokens, usage.get("completion_tokens", 0))
            timer.on_finish(time.monotonic())
            if finish_reason not in ("length", "stop"):
                record.error = f"finished with {finish_reason!r}"
        except Exception as e:  # noqa: BLE001 - one failed request is a figure, not a crash
            record.error = f"{type(e).__name__}: {e}"
        return record

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
