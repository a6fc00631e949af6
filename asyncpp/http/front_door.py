"""What a request passes before the engine hears of it, and what ends it early.

- `ApiKeyCheck`: with a key set, every path but /health (and /metrics, unless
  `metrics_require_key`) needs `Authorization: Bearer <key>`: /docs and
  /openapi.json included.
- `read_body`: a body is read only with a JSON content type (a cross-site page
  can post text/plain or a form without asking, never application/json), up
  to `max_body_bytes`.
- `decode_body`: it is parsed (nesting too deep for the parser is a 400, not
  a crash; NaN and Infinity parse, for the field's own check to name them),
  with no lone surrogate ("\\ud800") in any string, which no tokenizer or
  frame could carry, and validated into the endpoint's request model. A body
  over `OFF_LOOP_BODY_BYTES` is decoded on an executor thread
  (`decode_beside_loop`): parsed in steps (`loads_in_steps`: `json.loads`,
  one C call, would hold the GIL, and so the loop, for as long as it runs),
  then looked at cheaply to refuse what cannot fit whatever its details (a
  million chat messages) before the validation, which holds the GIL too and
  would take seconds.
- `FrontDoor`: at most `max_in_flight` requests at once; beyond, and while the
  server shuts down, a 503 at once (with Retry-After when it is only busy).
- `unless_disconnected`: await a request's work unless its client hangs up
  first, which cancels the work (and so aborts the request in the engine).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from asyncpp.http.errors import ApiError, bad_request, unavailable
from asyncpp.http.json_steps import loads_in_steps

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# Bodies larger than this are decoded off the loop (json.loads alone takes ~15 ms a MiB).
OFF_LOOP_BODY_BYTES = 256 * 1024

# A JSON escape of a UTF-16 surrogate; only such an escape can put a lone surrogate in a parsed string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ApiKeyCheck:
    """Refuses requests without `Authorization: Bearer <api_key>`. Plain ASGI: starlette's
    `BaseHTTPMiddleware` would relay every streamed chunk through a memory stream and a task."""

    def __init__(self, app, api_key: str, metrics_require_key: bool) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.open_paths = {"/health"} if metrics_require_key else {"/health", "/metrics"}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(auth, self.expected):
                error = ApiError(401, "missing or wrong API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class FrontDoor:
    """Counts the requests the server holds (from admission until their response has ended)."""

    def __init__(self, max_in_flight: int, retry_after_s: int = 1) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.is_stopping = False

    def check(self) -> None:
        """503 unless one more request could be admitted now."""
        if self.is_stopping:
            raise unavailable("the server is shutting down", "shutdown")
        if self.num_in_flight >= self.max_in_flight:
            message = f"the server is at its limit of {self.max_in_flight} requests at once; retry later"
            raise unavailable(message, "overloaded", self.retry_after_s)

    def enter(self) -> None:
        self.check()
        self.num_in_flight += 1

    def leave(self) -> None:
        self.num_in_flight -= 1


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body of a JSON request: 415 for another content type, 413 past `max_body_bytes`."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"the body must be JSON with Content-Type: application/json, got {content_type!r}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(int(declared), max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(size, max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(
    body: bytes, model_cls: type[M], check_size: Callable[[dict[str, Any]], None] | None = None, in_steps: bool = False
) -> M:
    """`body` as a `model_cls`, or an `ApiError` (400) naming what is wrong. `check_size`, if given,
    sees the parsed object before it is validated: it must be cheap, and raise `ApiError`."""
    value = parse_json(body, in_steps)
    if not isinstance(value, dict):
        raise bad_request("request body must be a JSON object")
    if check_size is not None:
        check_size(value)
    try:
        return model_cls.model_validate(value)
    except ValidationError as e:
        first = e.errors(include_url=False, include_context=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", str(first["loc"][0]) if first["loc"] else None) from e


async def decode_beside_loop(body: bytes, model_cls: type[M], check_size: Callable[[dict[str, Any]], None]) -> M:
    """`decode_body` on an executor thread, parsing in steps. A refusal comes back without its
    traceback, so that the parsed body its frames hold is freed there too, not on the loop."""

    def decode() -> tuple[M | None, ApiError | None]:
        try:
            return decode_body(body, model_cls, check_size, in_steps=True), None
        except ApiError as e:
            return None, ApiError(e.status, e.message, e.param, e.code, e.headers)

    request, error = await asyncio.get_running_loop().run_in_executor(None, decode)
    if error is not None:
        raise error
    return request


def parse_json(body: bytes, in_steps: bool = False) -> Any:
    """The parsed body; a 400 for bad JSON, nesting too deep, or a lone surrogate in any string.
    `in_steps`: parsed by `loads_in_steps`, which lets other threads run meanwhile."""
    try:
        value = loads_in_steps(body) if in_steps else json.loads(body)
    except RecursionError as e:
        raise bad_request("request body is not valid JSON: nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise bad_request(f"request body is not valid JSON: {e}") from e
    if _SURROGATE_ESCAPE.search(body) and (where := _lone_surrogate_at(value)) is not None:
        message = f"{where or 'body'}: strings must be valid Unicode, found a lone surrogate"
        raise bad_request(message, where.split(".")[0] or None)
    return value


def _too_large(num_bytes: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"request body of {num_bytes}+ bytes is over the {max_bytes}-byte limit")


def _lone_surrogate_at(value: Any) -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode; None if all are.
    Iterative: a body nested as deep as the parser allows must not exhaust the stack here."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _is_unicode(v):
                return path
        elif isinstance(v, dict):
            for key, item in v.items():
                at = f"{path}.{key}" if path else key
                if not _is_unicode(key):
                    return path
                stack.append((at, item))
        elif isinstance(v, list):
            nested = ((i, item) for i, item in enumerate(v) if isinstance(item, (str, dict, list)))  # not numbers
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in nested)
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client hangs up first, `work` is cancelled and `ClientDisconnected` raised.
    The body must have been read: what `receive` gives next is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # gone, or this handler itself was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled() and watcher.done() and not watcher.cancelled():
        raise ClientDisconnected()
    return task.result()


class ClientDisconnected(Exception):
    """The client hung up before its answer; nobody reads what is sent now."""


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
