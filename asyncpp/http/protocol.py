"""OpenAI request bodies (pydantic) and their translation into asyncpp `SamplingParams`.

Fields a vLLM user sends are accepted; fields OpenAI does not know are
ignored like OpenAI's own server does, wrong types are a 400 naming the
field. Types are strict: a number is never a string ("0.5"), floats are
finite, and integers fit 64 bits (the engine's frames carry no larger).
OpenAI's fields that asyncpp does not implement (`UNSUPPORTED`: tools,
response formats, logit bias, ...) are a 400 naming the field unless they ask
for nothing (`tools: []`, `response_format: {"type": "text"}`, null), so
that a client never takes plain text for what it asked. `stream_options`
is allowed only with `stream: true`, as OpenAI's API says. `n > 1` and
several prompts in one completion request are refused clearly (400).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from asyncpp.errors import InvalidRequestError

Int = Annotated[int, Strict(), Field(ge=-(2**63), lt=2**63)]
Float = Annotated[float, Strict(), AllowInfNan(False)]


# OpenAI's fields asyncpp does not implement -> (whether a value asks for nothing, what to send instead).
# null always asks for nothing. Chat's and completions' fields are all here: a model declares its own.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda v: v == [], "[]"),
    "tool_choice": (lambda v: v in ("none", "auto"), '"none"'),  # "auto" with no tool: nothing to call
    "functions": (lambda v: v == [], "[]"),
    "function_call": (lambda v: v in ("none", "auto"), '"none"'),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
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

    refuse_unsupported_common = field_validator("logit_bias", "response_format")(_refuse_unsupported)

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


def one_prompt(prompts: list[Any]) -> Any:
    """The one prompt of a list of prompts; several are refused."""
    if len(prompts) != 1:
        raise InvalidRequestError("prompt", f"one prompt per request is supported, got {len(prompts)}")
    return prompts[0]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

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
    parallel_tool_calls: StrictBool | None = None  # with no tools, nothing to call in parallel
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None

    refuse_unsupported = field_validator(
        "tools", "tool_choice", "functions", "function_call", "audio", "modalities", "prediction", "web_search_options"
    )(_refuse_unsupported)

    def engine_prompt(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs = true")
            return None
        return self.top_logprobs or 0
