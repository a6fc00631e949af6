"""OpenAI request bodies (pydantic) and their translation into asyncpp `SamplingParams`.

Fields a vLLM user sends are accepted; fields OpenAI does not know are
ignored like OpenAI's own server does, wrong types are a 400 naming the
field. Types are strict: a number is never a string ("0.5"), floats are
finite, and integers fit 64 bits (the engine's frames carry no larger).
OpenAI's fields that asyncpp does not implement (`UNSUPPORTED`: the
deprecated `functions`, logit bias, audio, ...) are a 400 naming the field
unless they ask for nothing (`logit_bias: {}`, null), so that a client never
takes plain text for what it asked. `response_format` (JSON object, JSON
schema) and vLLM's `structured_outputs` constrain the answer
(`asyncpp.structured`); `tools` and `tool_choice` are `http.tool_calls`'. `stream_options`
is allowed only with `stream: true`, as OpenAI's API says. `n > 1` and
several prompts in one completion request are refused clearly (400).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from asyncpp.errors import InvalidRequestError
from asyncpp.http.tool_calls import ToolRequest

Int = Annotated[int, Strict(), Field(ge=-(2**63), lt=2**63)]
Float = Annotated[float, Strict(), AllowInfNan(False)]


# OpenAI's fields asyncpp does not implement -> (whether a value asks for nothing, what to send instead).
# null always asks for nothing. Chat's and completions' fields are all here: a model declares its own.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (lambda v: v == [], "[] (or tools)"),
    "function_call": (lambda v: v in ("none", "auto"), '"none" (or tool_choice)'),
    "logit_bias": (lambda v: v == {}, "{}"),
    "audio": (lambda v: False, "null"),
    "modalities": (lambda v: v == ["text"], '["text"]'),
    "prediction": (lambda v: False, "null"),
    "web_search_options": (lambda v: False, "null"),
    "suffix": (lambda v: v == "", '""'),
    "best_of": (lambda v: type(v) is int and v == 1, "1"),
}


def _refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    asks_nothing, instead = UNSUPPORTED[info.field_name]
    if value is not None and not asks_nothing(value):
        raise PydanticCustomError("unsupported", "not supported by asyncpp (leave it out or send {instead})",
                                  {"instead": instead})  # fmt: skip
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # vLLM's continuous_usage_stats and the like: not implemented

    include_usage: StrictBool = False
    include_obfuscation: StrictBool = False  # OpenAI's padding against length side channels

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError("unsupported", "not supported by asyncpp (leave it out or send false)")
        return value


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Int | None = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = 0
    min_p: Float = 0.0
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    ignore_eos: StrictBool = False
    n: Int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: Any = None
    response_format: Any = None
    structured_outputs: Any = None  # vLLM's: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}

    refuse_unsupported_common = field_validator("logit_bias")(_refuse_unsupported)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is False:  # (absent from data: stream was invalid)
            raise PydanticCustomError("stream_only", "only allowed when stream is true")
        return value

    def sampling_dict(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        if self.n != 1:
            raise InvalidRequestError("n", f"only n = 1 is supported, got {self.n}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
        }
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        structured = response_format_outputs(self.response_format)
        if self.structured_outputs is not None:
            if structured is not None:
                raise InvalidRequestError("structured_outputs", "structured_outputs and a response_format other than text: send one")
            structured = self.structured_outputs
        if structured is not None:
            params["structured_outputs"] = structured
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    logprobs: Int | None = None
    echo: StrictBool = False
    max_tokens: Int | None = 16  # OpenAI's default for completions
    suffix: Any = None
    best_of: Any = None

    refuse_unsupported = field_validator("suffix", "best_of")(_refuse_unsupported)

    def engine_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = one_prompt(prompt)
        if self.echo:
            raise InvalidRequestError("echo", "echo is not supported")
        return prompt


def response_format_outputs(value: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as `structured_outputs` (None: free text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema", "response_format.json_schema.schema must be a JSON schema object")
        return {"json": schema}
    raise InvalidRequestError(
        "response_format.type", f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}'
    )


def structured_fields(req: _Common) -> dict[str, str]:
    """The request's own field for each error about its structured output (`response_format`'s)."""
    kind = req.response_format.get("type") if isinstance(req.response_format, dict) else None
    if req.structured_outputs is not None or kind not in ("json_object", "json_schema"):
        return {}
    return {"structured_outputs.json_object": "response_format", "structured_outputs.json": "response_format.json_schema.schema"}


def one_prompt(prompts: list[Any]) -> Any:
    """The one prompt of a list of prompts; several are refused."""
    if len(prompts) != 1:
        raise InvalidRequestError("prompt", f"one prompt per request is supported, got {len(prompts)}")
    return prompts[0]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, for the chat template
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None

    def template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("messages", f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    parallel_tool_calls: StrictBool | None = None  # false: "required" makes one call at most
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None

    refuse_unsupported = field_validator(
        "functions", "function_call", "audio", "modalities", "prediction", "web_search_options"
    )(_refuse_unsupported)

    def engine_prompt(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def tool_request(self) -> ToolRequest | None:
        tools = ToolRequest.parse(self.tools, self.tool_choice, self.parallel_tool_calls)
        if tools is not None and tools.is_forced and (self.response_format_asks or self.structured_outputs is not None):
            raise InvalidRequestError("tool_choice", f"tool_choice {tools.choice!r} with a response_format or structured_outputs: send one")
        return tools

    @property
    def response_format_asks(self) -> bool:
        return response_format_outputs(self.response_format) is not None

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs = true")
            return None
        return self.top_logprobs or 0
