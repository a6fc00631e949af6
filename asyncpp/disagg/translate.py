"""How a client's request becomes the engines' requests, and how their errors come back.

The prefill engine gets the client's prompt and sampling params with
`max_tokens` 1: its one token is the client's first (with its logprobs,
stop tokens and stop strings applied as one engine would), and the decode
engine goes on after it. A client asking for one token gets it from the
prefill engine alone. The router refuses what an engine would refuse, with
the engine's words (`invalid`), and hands an engine's `ErrorReply` on as it
was sent: the `AsyncClient` it reads engines with raises it as an exception,
which `error_reply` turns back into the reply. Two are reworded: an
engine_dead error names the engine, and an engine refusing the
`kv_transfer_params` the router gave it is "internal" (clients set none, so
it is not theirs to fix).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncpp.client import RequestFailedError
from asyncpp.errors import EngineDeadError, InvalidRequestError
from asyncpp.wire.client_msgs import ErrorReply, RequestDelta

DO_REMOTE_DECODE = {"do_remote_decode": True}


def prefill_params(params: dict[str, Any]) -> dict[str, Any]:
    """The client's sampling params for the prefill engine: the same, for one token."""
    return {**params, "max_tokens": 1}


def handed_on(delta: RequestDelta) -> RequestDelta:
    """The prefill engine's last delta of a request the decode engine goes on with, as the client
    gets it: its token, text and logprobs, not finished, no params."""
    return dataclasses.replace(delta, finished=False, finish_reason=None, stop_reason=None, kv_transfer_params=None)


def invalid(request_id: str, error_field: str, message: str) -> ErrorReply:
    """As an engine refuses: the message starts with the field (`InvalidRequestError`)."""
    return ErrorReply(request_id, str(InvalidRequestError(error_field, message)), "invalid_request", error_field)


def error_reply(request_id: str, error: Exception, engine_name: str, *, params_from_router: bool = True) -> ErrorReply:
    """The `ErrorReply` an engine sent, back from the exception `AsyncClient` raised for it.
    `params_from_router`: the request's `kv_transfer_params` were the router's, not the client's."""
    if isinstance(error, InvalidRequestError):
        message, prefix = error.message, f"{error.field}: "  # the engine's message, as it was sent
        if error.field == "kv_transfer_params" and params_from_router:  # not the client's fault
            why = message.removeprefix(prefix)  # the engine's own message names the field too
            return ErrorReply(request_id, f"{engine_name} refused the router's kv_transfer_params: {why}", "internal")
        # AsyncClient names a reply without a field "request".
        return ErrorReply(request_id, message, "invalid_request", None if error.field == "request" else error.field)
    if isinstance(error, EngineDeadError):
        return ErrorReply(request_id, f"{engine_name}: {error}", "engine_dead")
    if isinstance(error, RequestFailedError):
        kind, _, message = str(error).partition(": ")
        return ErrorReply(request_id, message, kind)
    return ErrorReply(request_id, f"{engine_name}: {error!r}", "internal")
