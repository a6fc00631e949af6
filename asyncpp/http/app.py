"""The FastAPI app: OpenAI's completions and chat completions, models, health, metrics.

Prompts are tokenized here (the chat template included), so the engine
receives token ids and the default `max_tokens` can be the rest of the
context, as in vLLM. The first reply of the engine is awaited before the
response starts, so a request the engine refuses (an over-long prompt) is a
400 even when streaming. A streaming client that disconnects cancels the
response, which closes the engine stream: `AsyncClient` then aborts the
request and the engine frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from asyncpp.client import AsyncClient
from asyncpp.engine.input_processor import InputProcessor
from asyncpp.errors import EngineDeadError, InvalidRequestError
from asyncpp.http.metrics import HttpMetrics, RequestTimes
from asyncpp.http.protocol import ChatCompletionRequest, CompletionRequest
from asyncpp.logging import get_logger
from asyncpp.wire.client_msgs import RequestDelta


@dataclass(frozen=True)
class HttpSettings:
    engine_address: str
    served_model_name: str
    max_model_len: int
    api_key: str | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def invalid(e: InvalidRequestError) -> ApiError:
    """A 400 for a request the engine (or the tokenizer) refused, its message without repeated field names."""
    message = str(e)
    while message.startswith(f"{e.field}: "):
        message = message[len(e.field) + 2 :]
    return bad_request(message, e.field)


def token_string(raw: bytes) -> str:
    """A token's text; a token that is not UTF-8 on its own is `bytes:\\xNN...` (vLLM's spelling),
    so that distinct tokens never share a key in the top-logprobs maps."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def build_app(settings: HttpSettings, processor: InputProcessor) -> FastAPI:
    log = get_logger(role="http")
    metrics = HttpMetrics(settings.served_model_name)
    token_bytes = processor.tokenizer.token_bytes_table()
    tokens = [token_string(b) for b in token_bytes]
    state: dict[str, AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = AsyncClient(settings.engine_address)
        yield
        state.pop("client").close()

    app = FastAPI(title="asyncpp", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(InvalidRequestError)  # from the tokenizer or the request's own checks
    async def on_invalid_request(request: Request, e: InvalidRequestError) -> JSONResponse:
        return invalid(e).response()

    if settings.api_key:
        app.add_middleware(_ApiKeyCheck, api_key=settings.api_key)

    async def parse(request: Request, model_cls):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"])
            raise bad_request(f"{param}: {first['msg']}", param) from e
        if req.model is not None and req.model != settings.served_model_name:
            raise ApiError(404, f"the model `{req.model}` does not exist", "NotFoundError", "model", "model_not_found")
        return req

    @app.get("/health")
    async def health() -> Response:
        try:
            ok = await state["client"].health(timeout_s=2.0)
        except (asyncio.TimeoutError, OSError):
            ok = False
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": settings.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "asyncpp",
                "max_model_len": settings.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            stats = await state["client"].stats(timeout_s=2.0)
        except (asyncio.TimeoutError, OSError):
            stats = None
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        prompt_ids = processor.tokenize(req.engine_prompt())
        params = req.sampling_dict(default_max_tokens(req.max_tokens, prompt_ids), req.logprobs)
        return await serve(req, prompt_ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        logprobs = req.logprobs_count()
        prompt_ids = processor.tokenize(req.engine_prompt())
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.sampling_dict(default_max_tokens(max_tokens, prompt_ids), logprobs)
        return await serve(req, prompt_ids, params, chat=True)

    def default_max_tokens(max_tokens: int | None, prompt_ids: list[int]) -> int:
        """Unset: the rest of the context (at least 1, so that an over-long prompt is refused by its length)."""
        return max_tokens if max_tokens is not None else max(1, settings.max_model_len - len(prompt_ids))

    async def serve(req, prompt_ids: list[int], params: dict[str, Any], chat: bool) -> Response:
        client = state["client"]
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        times = RequestTimes(time.monotonic(), metrics)
        stream = client.generate(prompt_ids, params, request_id=request_id)
        first = await first_delta(stream, times)
        log.debug("http_request", request_id=request_id, chat=chat, stream=req.stream, num_prompt_tokens=len(prompt_ids))
        formatter = _Formatter(request_id, created, settings.served_model_name, chat, tokens, token_bytes)
        if req.stream:
            return StreamingResponse(
                sse(stream, first, times, formatter, req.include_usage), media_type="text/event-stream"
            )
        deltas = [first]
        finish = first.finish_reason if first.finished else None
        try:
            if not first.finished:
                async for delta in stream:
                    times.on_tokens(time.monotonic(), len(delta.token_ids), delta.num_prompt_tokens)
                    deltas.append(delta)
                    finish = delta.finish_reason if delta.finished else finish
        except Exception as e:
            metrics.request_done(times, None)
            raise engine_error(e) from e
        metrics.request_done(times, finish)
        return JSONResponse(formatter.full(deltas, times))

    async def first_delta(stream: AsyncIterator[RequestDelta], times: RequestTimes) -> RequestDelta:
        try:
            first = await stream.__anext__()
        except Exception as e:
            metrics.request_done(times, None)
            raise engine_error(e) from e
        times.on_tokens(time.monotonic(), len(first.token_ids), first.num_prompt_tokens)
        return first

    def engine_error(e: Exception) -> ApiError:
        if isinstance(e, InvalidRequestError):
            return invalid(e)
        if isinstance(e, EngineDeadError):
            return ApiError(503, str(e), "ServiceUnavailableError", code="engine_dead")
        return ApiError(500, f"{type(e).__name__}: {e}", "InternalServerError")

    async def sse(stream, first: RequestDelta, times: RequestTimes, formatter: "_Formatter", include_usage: bool):
        finish = None
        try:
            yield formatter.sse(formatter.chunk(first, is_first=True))
            finish = first.finish_reason if first.finished else None
            if not first.finished:
                async for delta in stream:
                    times.on_tokens(time.monotonic(), len(delta.token_ids), delta.num_prompt_tokens)
                    yield formatter.sse(formatter.chunk(delta))
                    if delta.finished:
                        finish = delta.finish_reason
            if include_usage:
                yield formatter.sse(formatter.usage_chunk(times))
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is gone: the error travels as an event
            if isinstance(e, asyncio.CancelledError):
                raise
            err = engine_error(e)
            yield formatter.sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})
        finally:
            await stream.aclose()  # a disconnected client: the engine aborts the request
            metrics.request_done(times, finish)

    return app


class _ApiKeyCheck:
    """Refuses /v1/ requests without `Authorization: Bearer <api_key>`. Plain ASGI: starlette's
    `BaseHTTPMiddleware` would relay every streamed chunk through a memory stream and a task."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(auth, self.expected):
                error = ApiError(401, "missing or wrong API key", "AuthenticationError", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Formatter:
    """OpenAI's response shapes for one request."""

    def __init__(self, request_id: str, created: int, model: str, chat: bool, tokens: list[str], token_bytes: list[bytes]):
        self.request_id, self.created, self.model, self.chat = request_id, created, model, chat
        self.tokens, self.token_bytes = tokens, token_bytes

    @staticmethod
    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokens[token_id] if 0 <= token_id < len(self.tokens) else ""

    def _logprobs(self, deltas: list[RequestDelta]) -> dict[str, Any] | None:
        pairs = [(t, lp) for d in deltas if d.logprobs is not None for t, lp in zip(d.token_ids, d.logprobs)]
        if not any(d.logprobs is not None for d in deltas):
            return None
        if self.chat:
            content = []
            for token_id, lp in pairs:
                top = [
                    {"token": self._token(i), "logprob": v, "bytes": list(self.token_bytes[i])}
                    for i, v in zip(lp.top_token_ids, lp.top_logprobs)
                ]
                content.append({"token": self._token(token_id), "logprob": lp.token_logprob,
                                "bytes": list(self.token_bytes[token_id]), "top_logprobs": top})  # fmt: skip
            return {"content": content}
        return {
            "tokens": [self._token(t) for t, _ in pairs],
            "token_logprobs": [lp.token_logprob for _, lp in pairs],
            "top_logprobs": [{self._token(i): v for i, v in zip(lp.top_token_ids, lp.top_logprobs)} for _, lp in pairs],
            "text_offset": [],
        }

    def chunk(self, delta: RequestDelta, is_first: bool = False) -> dict[str, Any]:
        finish = delta.finish_reason if delta.finished else None
        if self.chat:
            message = {"role": "assistant", "content": delta.text} if is_first else {"content": delta.text}
            choice = {"index": 0, "delta": message, "logprobs": self._logprobs([delta]), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.text, "logprobs": self._logprobs([delta]), "finish_reason": finish}
        if delta.finished and delta.stop_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        return {**self._base(chunk=True), "choices": [choice]}

    def usage(self, times: RequestTimes) -> dict[str, int]:
        return {
            "prompt_tokens": times.num_prompt_tokens,
            "completion_tokens": times.num_output_tokens,
            "total_tokens": times.num_prompt_tokens + times.num_output_tokens,
        }

    def usage_chunk(self, times: RequestTimes) -> dict[str, Any]:
        return {**self._base(chunk=True), "choices": [], "usage": self.usage(times)}

    def full(self, deltas: list[RequestDelta], times: RequestTimes) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        finish = last.finish_reason if last.finished else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": self._logprobs(deltas),
                      "finish_reason": finish}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(deltas), "finish_reason": finish}
        if last.stop_reason is not None:
            choice["stop_reason"] = last.stop_reason
        return {**self._base(chunk=False), "choices": [choice], "usage": self.usage(times)}
