"""Render a model's Jinja chat template the way HF transformers does.

Contract: `ChatTemplate(source, bos_token=..., eos_token=...).render(messages,
add_generation_prompt=...)` returns the same string as transformers'
`apply_chat_template(..., tokenize=False)`: same Jinja options (sandboxed,
`trim_blocks`, `lstrip_blocks`, loop controls), the same `raise_exception`,
`strftime_now` and `tojson` helpers, and `bos_token`/`eos_token` variables.
Messages are validated first: a non-empty list of dicts each with a `str`
`role` and `str` `content` (other keys pass through to the template). Bad
messages, a template that does not compile, and a template that raises all
become `ValueError`, which callers map to a client error.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def validate_messages(messages: Any) -> None:
    """Raise `ValueError` naming the first malformed message."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{index}] has no {key!r}")
            if not isinstance(message[key], str):
                raise ValueError(f"messages[{index}][{key!r}] must be a str, "
                                 f"got {type(message[key]).__name__}")


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject a conversation (e.g. roles not alternating).
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes `<>&'`; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        # Undefined tokens stay undefined (render as ""), as in HF.
        self._token_vars = {name: token for name, token in
                            (("bos_token", bos_token), ("eos_token", eos_token)) if token is not None}

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """`tools`: OpenAI's tool definitions, as HF passes them (`tools` is undefined without)."""
        validate_messages(messages)
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._token_vars, **extra)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e
