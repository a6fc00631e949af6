"""OpenAI request bodies (pydantic) and their translation into asyncpp `SamplingParams`.

Fields a vLLM user sends are accepted; unknown fields are ignored like
OpenAI's own server does, wrong types are a 400 naming the field. Types are
strict: a number is never a string ("0.5"), floats are finite, and integers
fit 64 bits (the engine's frames carry no larger). `n > 1` and several
prompts in one completion request are refused clearly (400).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool

from asyncpp.errors import InvalidRequestError

Int = Annotated[int, Strict(), Field(ge=-(2**63), lt=2**63)]
Float = Annotated[float, Strict(), AllowInfNan(False)]


class StreamOptions(BaseModel):
    include_usage: bool = False


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

    def engine_prompt(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs = true")
            return None
        return self.top_logprobs or 0
