"""Every refusal of the HTTP server in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.

Whatever refuses a request answers this way: its own checks (`ApiError`,
`InvalidRequestError`, named by the request's own field), routing (404 and
405, never FastAPI's `{"detail": ...}`), the engine (`engine_error`), and a
bug (a logged 500 that keeps the connection, never a plain-text page).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from asyncpp.client import RequestFailedError
from asyncpp.errors import EngineDeadError, InvalidRequestError
from asyncpp.logging import get_logger

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def unavailable(message: str, code: str, retry_after_s: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return ApiError(503, message, code=code, headers=headers)


def invalid(e: InvalidRequestError, rename: dict[str, str] | None = None) -> ApiError:
    """A 400 for a request the engine, the tokenizer or the request's own checks refused: `param` is
    the request's field (`rename` maps the engine's names to the endpoint's), named once."""
    message = e.message
    while message.startswith(f"{e.field}: "):  # an engine's older replies repeat the field
        message = message[len(e.field) + 2 :]
    param = (rename or {}).get(e.field, e.field)
    if param != e.field and message.startswith(e.field):
        message = param + message[len(e.field) :]
    return bad_request(message, None if param == "request" else param)


def engine_error(e: Exception, rename: dict[str, str] | None = None) -> ApiError:
    """What the client of an engine raised, as the HTTP error it means."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return invalid(e, rename)
    if isinstance(e, EngineDeadError):
        return unavailable(str(e), "engine_dead")
    if isinstance(e, RequestFailedError) and e.kind == "shutdown":
        return unavailable(e.message, "shutdown")
    return ApiError(500, f"{type(e).__name__}: {e}")


def install_handlers(app: FastAPI) -> None:
    log = get_logger(role="http")

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(request: Request, e: InvalidRequestError) -> JSONResponse:
        return invalid(e).response()

    @app.exception_handler(HTTPException)  # no such route (404), or not with this method (405)
    async def on_http_exception(request: Request, e: HTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail), headers=e.headers).response()

    app.add_middleware(_CatchAll, log=log)


class _CatchAll:
    """A bug's exception becomes a logged JSON 500 here instead of reaching starlette's outermost
    middleware, which would answer in plain text and re-raise it, and uvicorn then drops the
    connection. Plain ASGI, as `ApiKeyCheck`, so streamed chunks pass straight through."""

    def __init__(self, app, log) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:  # noqa: BLE001 - the last stop before the server: answer, log, go on
            self.log.exception("http_internal_error", path=scope.get("path"), error=repr(e))
            if started:  # a stream already under way: it ends here
                raise
            await ApiError(500, f"internal error: {type(e).__name__}").response()(scope, receive, send)
