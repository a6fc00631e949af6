"""The FastAPI app: OpenAI's completions and chat completions, models, health, metrics.

Prompts are tokenized here (the chat template included), so the engine
receives token ids and the default `max_tokens` can be the rest of the
context, as in vLLM. What the engine would refuse is refused here first, in
the request's own field names: the sampling parameters, the prompt against
`max_model_len` (a text far too long by its length alone, before tokenizing
it, a chat with too many messages by their number, before its template runs;
a long one is tokenized off the event loop), and the request's frame against
the engine's `max_frame_bytes` (in `AsyncClient`). A big body is decoded off
the event loop, and what it cannot fit whatever its details (a million
messages) is refused before it is validated (`check_chat_size`,
`check_prompt_size`), so that no request holds up the others. The first reply
of the engine is awaited before the response starts, so a request the engine
refuses is a 4xx even when streaming.

Requests go only to the engine run this server was started for, and get a
503 within seconds while it cannot be reached (`EngineGuard`). A request
holds its place at the front door (`FrontDoor`) until its response has
ended. A client that hangs up has its request aborted in the engine at once:
while its answer is awaited (`unless_disconnected`) or streamed
(starlette cancels the stream). At shutdown (`begin_shutdown`) new requests
get a 503, the open ones have the grace period to finish, and those left then
end: with a 503 or, in a stream, an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from asyncpp.client import AsyncClient
from asyncpp.engine.input_processor import InputProcessor, tokenizes_off_loop
from asyncpp.errors import InvalidRequestError
from asyncpp.http.engine_guard import EngineGuard
from asyncpp.http.errors import ApiError, bad_request, engine_error, install_handlers, invalid
from asyncpp.http.formatter import Formatter, token_string
from asyncpp.http.front_door import (
    OFF_LOOP_BODY_BYTES,
    ApiKeyCheck,
    ClientDisconnected,
    FrontDoor,
    decode_beside_loop,
    decode_body,
    read_body,
    unless_disconnected,
)
from asyncpp.http.metrics import HttpMetrics, RequestTimes
from asyncpp.http.protocol import ChatCompletionRequest, CompletionRequest, one_prompt, structured_fields
from asyncpp.http.tool_calls import ToolRequest
from asyncpp.logging import get_logger
from asyncpp.sampling.params import SamplingParams, check_list_lengths
from asyncpp.wire.client_msgs import RequestDelta

# Bodies are read up to max(this, 4 x the engine's frame limit): room for any prompt that can fit.
MIN_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class HttpSettings:
    engine_address: str
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    metrics_require_key: bool = False
    max_in_flight: int = 1024 + 64  # server.max_queued_requests + scheduler.max_num_seqs
    max_frame_bytes: int = 8 * 1024 * 1024  # server.max_frame_bytes, the engine's
    grace_period_s: float = 5.0  # at shutdown, for open requests to finish
    client_secret: str = field(default="", repr=False)  # what the engine's client port asks of clients
    engine_id: str | None = None  # the engine run to serve (None: the first one reached); see `EngineGuard`
    exits_when_engine_lost: bool = False  # started by the launcher: its engine's run cannot come back


def build_app(
    settings: HttpSettings, processor: InputProcessor, on_fatal: Callable[[str], None] = lambda reason: None
) -> FastAPI:
    """`on_fatal(reason)`: the engine this server serves is gone for good (or another is at its address)."""
    log = get_logger(role="http")
    metrics = HttpMetrics(settings.served_model_name)
    token_bytes = processor.tokenizer.token_bytes_table()
    tokens = [token_string(b) for b in token_bytes]
    door = FrontDoor(settings.max_in_flight)
    max_body_bytes = max(MIN_MAX_BODY_BYTES, 4 * settings.max_frame_bytes)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = AsyncClient(
            settings.engine_address, settings.max_frame_bytes, secret=settings.client_secret, watch_connection=True
        )
        guard = EngineGuard(
            client, settings.engine_id, exits_when_lost=settings.exits_when_engine_lost, on_fatal=on_fatal
        )
        state["client"], state["guard"] = client, guard
        guard.start()
        yield
        guard.close()
        state.pop("client").close()

    app = FastAPI(title="asyncpp", lifespan=lifespan)
    install_handlers(app)
    if settings.api_key:
        app.add_middleware(ApiKeyCheck, api_key=settings.api_key, metrics_require_key=settings.metrics_require_key)

    async def begin_shutdown(is_forced: Callable[[], bool] = lambda: False) -> None:
        """Refuse new requests, give the open ones the grace period, then end those left."""
        door.is_stopping = True
        deadline = time.monotonic() + settings.grace_period_s
        while door.num_in_flight and time.monotonic() < deadline and not is_forced():
            await asyncio.sleep(0.05)
        if "client" in state:
            state["client"].end_all("the server shut down before the request finished")

    app.state.begin_shutdown = begin_shutdown

    async def parse(request: Request, model_cls, check_size: Callable[[dict[str, Any]], None]):
        door.check()  # full, or shutting down: 503 before the body is even read
        body = await read_body(request, max_body_bytes)
        if len(body) > OFF_LOOP_BODY_BYTES:
            req = await decode_beside_loop(body, model_cls, check_size)
        else:
            req = decode_body(body, model_cls)
        if req.model is not None and req.model != settings.served_model_name:
            raise ApiError(404, f"the model `{req.model}` does not exist", "model", "model_not_found")
        return req

    # What a big body cannot fit whatever its details, refused before it is validated (which for a
    # million items takes seconds): more chat messages or prompt token ids than max_model_len tokens
    # can hold, several prompts.
    # Lists the sampling parameters bound (stop strings, stop token ids) and content parts (more than
    # max_model_len in one request: no template makes them fit) are refused by their lengths too.
    def check_chat_size(body: dict[str, Any]) -> None:
        if isinstance(messages := body.get("messages"), list):
            try:
                processor.check_chat_size(messages, {"developer": "system"})  # as `engine_prompt` sends them
                num_parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
                if num_parts > settings.max_model_len:
                    message = f"{num_parts} content parts, more than max_model_len {settings.max_model_len} can hold"
                    raise InvalidRequestError("messages", message)
            except InvalidRequestError as e:
                raise invalid(e) from e
        check_list_sizes(body)

    def check_prompt_size(body: dict[str, Any]) -> None:
        if isinstance(prompt := body.get("prompt"), list) and len(prompt) > settings.max_model_len:
            try:
                if isinstance(prompt[0], (str, list)):
                    one_prompt(prompt)
                elif isinstance(prompt[0], int):
                    processor.check_lengths(len(prompt), 0)
            except InvalidRequestError as e:
                raise invalid(e) from e
        check_list_sizes(body)

    def check_list_sizes(body: dict[str, Any]) -> None:
        stop, stop_token_ids = body.get("stop"), body.get("stop_token_ids")
        try:
            check_list_lengths(len(stop) if isinstance(stop, list) else 0,
                               len(stop_token_ids) if isinstance(stop_token_ids, list) else 0, processor.vocab_size)  # fmt: skip
        except InvalidRequestError as e:
            raise invalid(e) from e

    @app.get("/health")
    async def health() -> Response:
        if door.is_stopping or not await state["guard"].serves_within(2.0):
            return Response(status_code=503)
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
        stats = None
        if state["guard"].is_serving:  # (never another engine's)
            try:
                stats = await state["client"].stats(timeout_s=2.0)
            except (asyncio.TimeoutError, OSError):
                pass
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest, check_prompt_size)
        rename = {"prompt_token_ids": "prompt", **structured_fields(req)}
        try:
            prompt_ids = await tokenize(req.engine_prompt())
            params = req.sampling_dict(default_max_tokens(req.max_tokens, prompt_ids), req.logprobs)
            check(prompt_ids, params)
        except InvalidRequestError as e:
            raise invalid(e, rename) from e
        return await serve(request, req, prompt_ids, params, False, rename)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest, check_chat_size)
        rename = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs", **structured_fields(req)}
        if req.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        tools = None
        try:
            logprobs = req.logprobs_count()
            tools = req.tool_request()
            prompt_ids = await tokenize(req.engine_prompt(), tools.tools if tools is not None else None)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = req.sampling_dict(default_max_tokens(max_tokens, prompt_ids), logprobs)
            if tools is not None and (structured := tools.structured_outputs()) is not None:
                params["structured_outputs"] = structured
                rename["structured_outputs.json"] = tools.field
            check(prompt_ids, params)
        except InvalidRequestError as e:
            raise invalid(e, rename) from e
        return await serve(request, req, prompt_ids, params, True, rename, tools)

    async def tokenize(prompt: str | list[int] | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if tokenizes_off_loop(prompt):  # (one that cannot fit is refused by its length at once)
            return await asyncio.get_running_loop().run_in_executor(None, processor.tokenize, prompt, tools)
        return processor.tokenize(prompt, tools)

    def check(prompt_ids: list[int], params: dict[str, Any]) -> None:
        """What the engine would refuse: bad sampling values, a prompt and answer over max_model_len."""
        sampling = SamplingParams.from_dict(params)
        processor.validate(sampling)
        processor.check_lengths(len(prompt_ids), sampling.max_tokens)

    def default_max_tokens(max_tokens: int | None, prompt_ids: list[int]) -> int:
        """Unset: the rest of the context (at least 1, so that an over-long prompt is refused by its length)."""
        return max_tokens if max_tokens is not None else max(1, settings.max_model_len - len(prompt_ids))

    async def serve(request: Request, req, prompt_ids: list[int], params: dict[str, Any], chat: bool,
                    rename: dict[str, str], tools: ToolRequest | None = None) -> Response:  # fmt: skip
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        door.enter()
        try:
            await state["guard"].admit()  # held at the door meanwhile: it counts against the bound
        except BaseException:
            door.leave()
            raise
        stream = state["client"].generate(prompt_ids, params, request_id=request_id)
        exchange: _Exchange | None = _Exchange(stream, RequestTimes(time.monotonic(), metrics), metrics, door)
        try:
            first = await unless_disconnected(request, exchange.next())
            log.debug("http_request", request_id=request_id, chat=chat, stream=req.stream, num_prompt_tokens=len(prompt_ids))
            formatter = Formatter(request_id, int(time.time()), settings.served_model_name, chat, tokens, token_bytes, tools)
            if req.stream:
                events = sse(exchange, first, formatter, req.include_usage, rename)
                response = _EngineStream(events, exchange.close, media_type="text/event-stream")
                exchange = None  # the response closes it, however it ends
                return response
            deltas = [first] if first.finished else [first, *await unless_disconnected(request, exchange.rest())]
            return JSONResponse(formatter.full(deltas, exchange.times))
        except ClientDisconnected:
            return bad_request("the client disconnected").response()  # nobody reads it
        except Exception as e:
            if exchange is not None:
                exchange.has_failed = True
            raise engine_error(e, rename) from e
        finally:
            if exchange is not None:
                await exchange.close()

    async def sse(exchange: _Exchange, first: RequestDelta, formatter: Formatter, include_usage: bool,
                  rename: dict[str, str]) -> AsyncIterator[str]:  # fmt: skip
        for chunk in formatter.chunks(first, is_first=True):
            yield formatter.sse(chunk)
        try:
            if not first.finished:
                async for delta in exchange.stream:
                    exchange.record(delta)
                    for chunk in formatter.chunks(delta):
                        yield formatter.sse(chunk)
            if include_usage:
                yield formatter.sse(formatter.usage_chunk(exchange.times))
        except Exception as e:  # noqa: BLE001 - the status line is gone: the error travels as an event
            exchange.has_failed = True
            yield formatter.sse(engine_error(e, rename).body())
        yield "data: [DONE]\n\n"

    return app


class _Exchange:
    """One request's engine stream and its bookkeeping. `close` (once, however the request ended)
    aborts it in the engine unless it finished, counts it in the metrics and frees its place."""

    def __init__(self, stream: AsyncIterator[RequestDelta], times: RequestTimes, metrics: HttpMetrics,
                 door: FrontDoor) -> None:  # fmt: skip
        self.stream, self.times, self.metrics, self.door = stream, times, metrics, door
        self.finish_reason: str | None = None
        self.has_failed = False  # it ended in an error; neither finished nor failed: the client left (an abort)
        self.is_closed = False

    def record(self, delta: RequestDelta) -> None:
        self.times.on_tokens(time.monotonic(), len(delta.token_ids), delta.num_prompt_tokens)
        if delta.finished:
            self.finish_reason = delta.finish_reason

    async def next(self) -> RequestDelta:
        delta = await anext(self.stream)
        self.record(delta)
        return delta

    async def rest(self) -> list[RequestDelta]:
        deltas = []
        async for delta in self.stream:
            self.record(delta)
            deltas.append(delta)
        return deltas

    async def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        self.door.leave()
        self.metrics.request_done(self.times, self.finish_reason, self.has_failed)
        await self.stream.aclose()  # unfinished: `AsyncClient` aborts it in the engine


class _EngineStream(StreamingResponse):
    """Server-sent events that close their exchange however the response ends: done, failed,
    cancelled by a disconnect, or never started (a client gone before the first byte)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
