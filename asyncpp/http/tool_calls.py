"""OpenAI tool calling on the chat endpoint: `tools`, `tool_choice`, and `tool_calls` in answers.

* `tool_choice: {"type": "function", "function": {"name": N}}`: the answer is the arguments of N,
  generated under the JSON schema of its `parameters` (structured outputs), returned as one call.
* `"required"`: a JSON array of 1+ calls (1 without `parallel_tool_calls`), each
  `{"name": one of the tools, "parameters": its arguments}`, generated under the schema that says so.
* `"auto"` (the default with tools): the model answers freely; calls written as
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (the Hermes convention that Qwen,
  Hermes and SmolLM3 templates teach) become `tool_calls`, the rest stays content.
* `"none"`: no call; the tools still reach the chat template.
The tools are handed to the chat template as `tools` (a template that does not use them ignores
them). A malformed tool or choice is a 400 naming its field (`tools[1].function.parameters`); a
parameters schema that does not compile is one too, before anything is scheduled.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from asyncpp.errors import InvalidRequestError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_OPEN = "<tool_call>"
DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as given (validated): what the chat template gets
    parameters: dict[str, dict[str, Any]]  # name -> its parameters' JSON schema
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @staticmethod
    def parse(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
        """None when nothing is asked of tools (no tools, or an empty list and no choice)."""
        if tools is None or tools == []:
            if tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice", f"tool_choice {_short(tool_choice)} needs tools")
            return None
        if not isinstance(tools, list):
            raise InvalidRequestError("tools", f"tools must be a list, got {type(tools).__name__}")
        parameters: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools):
            name, schema = _parse_tool(tool, f"tools[{i}]")
            if name in parameters:
                raise InvalidRequestError(f"tools[{i}].function.name", f"tools[{i}].function.name {name!r} is given twice")
            parameters[name] = schema
        named = None
        if tool_choice is None:
            choice = "auto"
        elif tool_choice in ("none", "auto", "required"):
            choice = tool_choice
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            function = tool_choice.get("function")
            named = function.get("name") if isinstance(function, dict) else None
            if named not in parameters:
                raise InvalidRequestError("tool_choice", f"tool_choice names function {named!r}, which is not in tools")
            choice = "named"
        else:
            raise InvalidRequestError(
                "tool_choice", f'tool_choice must be "none", "auto", "required" or a function, got {_short(tool_choice)}'
            )
        return ToolRequest(tools, parameters, choice, named, parallel_tool_calls is not False)

    def structured_outputs(self) -> dict[str, Any] | None:
        """What the answer is generated under (None: free text)."""
        if self.choice == "named":
            return {"json": self.parameters[self.named]}
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.parameters.items()
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": array}

    @property
    def field(self) -> str:
        """Where a schema that does not compile came from."""
        if self.choice == "named":
            index = next(i for i, t in enumerate(self.tools) if t["function"]["name"] == self.named)
            return f"tools[{index}].function.parameters"
        return "tools"

    @property
    def is_forced(self) -> bool:
        """The whole answer is calls."""
        return self.choice in ("named", "required")

    def calls(self, text: str) -> tuple[list[dict[str, Any]], str | None]:
        """The answer's tool calls in OpenAI's shape, and the content left (None if none)."""
        if self.choice == "named":
            return [_call(self.named, text)], None
        if self.choice == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut short (max_tokens): no call, the text as it is
                return [], text
            return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items], None
        if self.choice == "none" or CALL_OPEN not in text:
            return [], text
        calls: list[dict[str, Any]] = []

        def take(block: re.Match[str]) -> str:
            call = self._hermes_call(block.group(1))
            if call is None:
                return block.group(0)  # not a call of these tools after all: stays content
            calls.append(call)
            return ""

        content = _CALL.sub(take, text).strip()
        if not calls:
            return [], text
        return calls, content or None

    def _hermes_call(self, body: str) -> dict[str, Any] | None:
        """`{"name": ..., "arguments": {...}}` (or "parameters") naming one of the tools, as a call."""
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            return None
        if name not in self.parameters:
            return None
        return _call(name, json.dumps(arguments, ensure_ascii=False))


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _parse_tool(tool: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f"{where}.type", f'{where}.type must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function", f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.function.name", f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _ and -")
    if "description" in function and not isinstance(function["description"], str):
        raise InvalidRequestError(f"{where}.function.description", f"{where}.function.description must be a string")
    schema = function.get("parameters", DEFAULT_PARAMETERS)
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema object")
    return name, schema


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class ToolCallStream:
    """One streamed answer's chunks' `delta`s under a `ToolRequest`: a named function's arguments as
    they come; a required answer's calls once it is complete; an auto answer's content as it comes,
    held from the first `<tool_call>` on, whose calls come at its end."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.buffer = ""  # text not sent yet
        self.in_call = False  # auto: a call has begun
        self.num_calls = 0
        self._named_id = _call("", "")["id"]

    def deltas(self, text: str, is_first: bool, is_last: bool) -> list[dict[str, Any]]:
        """The `delta` objects for this piece of the answer (the first one carries the role)."""
        out: list[dict[str, Any]] = []
        if self.tools.choice == "named":
            function: dict[str, Any] = {"arguments": text}
            call: dict[str, Any] = {"index": 0, "function": function}
            if is_first:
                call.update(id=self._named_id, type="function")
                function["name"] = self.tools.named
                self.num_calls = 1
            out.append({"tool_calls": [call]})
        else:
            self.buffer += text
            if self.tools.choice == "auto" and not self.in_call:
                out.extend(self._content())
            if is_last:
                out.extend(self._rest())
        if is_first:
            out = out or [{}]
            out[0] = {"role": "assistant", **({"content": None} if "tool_calls" in out[0] else {}), **out[0]}
        return out

    def _content(self) -> list[dict[str, Any]]:
        """Auto: the content before any call (a tail that may begin `<tool_call>` is held)."""
        at = self.buffer.find(CALL_OPEN)
        if at >= 0:
            self.in_call = True
        else:
            at = next((i for i in range(len(self.buffer)) if CALL_OPEN.startswith(self.buffer[i:])), len(self.buffer))
        sent, self.buffer = self.buffer[:at], self.buffer[at:]
        return [{"content": sent}] if sent else []

    def _rest(self) -> list[dict[str, Any]]:
        calls, content = self.tools.calls(self.buffer) if (self.in_call or self.tools.is_forced) else ([], self.buffer)
        self.buffer = ""
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for index, call in enumerate(calls):
            out.append({"tool_calls": [{"index": index, **call}]})
        self.num_calls = len(calls)
        return out
