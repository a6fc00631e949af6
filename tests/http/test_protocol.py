"""The request models on their own (no server): OpenAI's fields asyncpp does not implement, typed
`stream_options`, one prompt per request. The launched front door checks the same through HTTP."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncpp.errors import InvalidRequestError
from asyncpp.http.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest, one_prompt

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
CHAT_ONLY = {"functions", "function_call", "audio", "modalities", "prediction", "web_search_options"}
COMPLETION_ONLY = {"suffix", "best_of"}
ASKS_SOMETHING = {
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "logit_bias": {"7": 100},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "suffix": "end",
    "best_of": 3,
}
ASKS_NOTHING = {
    "functions": [[]], "function_call": ["none", "auto"], "logit_bias": [{}], "modalities": [["text"]], "suffix": [""],
    "best_of": [1], "audio": [], "prediction": [], "web_search_options": [],
}  # fmt: skip


def model_for(field: str):
    if field in CHAT_ONLY:
        return ChatCompletionRequest, CHAT
    if field in COMPLETION_ONLY:
        return CompletionRequest, COMPLETION
    return ChatCompletionRequest, CHAT  # either: both have it


def refusal(model, body: dict) -> dict:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value.errors()[0]


def test_the_lists_cover_every_unsupported_field():
    assert set(ASKS_SOMETHING) == set(ASKS_NOTHING) == set(UNSUPPORTED) == CHAT_ONLY | COMPLETION_ONLY | {"logit_bias"}


@pytest.mark.parametrize("field", sorted(ASKS_SOMETHING))
def test_an_unsupported_field_that_asks_for_something_is_refused_naming_it(field):
    model, base = model_for(field)
    error = refusal(model, {**base, field: ASKS_SOMETHING[field]})
    assert error["loc"] == (field,) and error["type"] == "unsupported", error
    instead = UNSUPPORTED[field][1]
    assert error["msg"] == f"not supported by asyncpp (leave it out or send {instead})"
    if field == "logit_bias":  # both endpoints have it
        assert refusal(CompletionRequest, {**COMPLETION, field: ASKS_SOMETHING[field]})["loc"] == (field,)


@pytest.mark.parametrize("field", sorted(ASKS_NOTHING))
def test_an_unsupported_field_that_asks_for_nothing_is_taken(field):
    model, base = model_for(field)
    for value in [None, *ASKS_NOTHING[field]]:
        model.model_validate({**base, field: value})


def test_best_of_true_is_not_one():
    assert refusal(CompletionRequest, {**COMPLETION, "best_of": True})["loc"] == ("best_of",)
    assert refusal(CompletionRequest, {**COMPLETION, "best_of": 1.0})["loc"] == ("best_of",)


def test_fields_openai_does_not_know_are_ignored():
    req = ChatCompletionRequest.model_validate({**CHAT, "made_up": {"anything": 1}})
    assert not hasattr(req, "made_up")


@pytest.mark.parametrize("model,base", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)])
def test_stream_options_are_typed_and_only_allowed_when_streaming(model, base):
    assert model.model_validate({**base, "stream": True, "stream_options": {"include_usage": True}}).include_usage
    assert not model.model_validate({**base, "stream": True, "stream_options": {}}).include_usage
    assert not model.model_validate({**base, "stream": True}).include_usage
    assert not model.model_validate({**base, "stream": True, "stream_options": {"include_obfuscation": False}}).include_usage
    for stream in ({"stream": False}, {}):
        error = refusal(model, {**base, **stream, "stream_options": {"include_usage": True}})
        assert error["loc"] == ("stream_options",) and error["msg"] == "only allowed when stream is true", error
    model.model_validate({**base, "stream": False, "stream_options": None})
    cases = [({"include_usage": "yes"}, ("stream_options", "include_usage")),
             ({"include_usage": 1}, ("stream_options", "include_usage")),
             ({"continuous_usage_stats": True}, ("stream_options", "continuous_usage_stats")),
             ({"include_obfuscation": True}, ("stream_options", "include_obfuscation"))]  # fmt: skip
    for options, loc in cases:
        error = refusal(model, {**base, "stream": True, "stream_options": options})
        assert error["loc"] == loc, error
    assert refusal(model, {**base, "stream": "yes", "stream_options": {}})["loc"] == ("stream",)


def test_one_prompt_per_request():
    assert one_prompt(["a"]) == "a"
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).engine_prompt() == [1, 2]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).engine_prompt() == [1, 2]
    for prompts in ([], ["a", "b"]):
        with pytest.raises(InvalidRequestError, match=f"one prompt per request is supported, got {len(prompts)}") as info:
            one_prompt(prompts)
        assert info.value.field == "prompt"


def test_parallel_tool_calls_is_a_real_boolean():
    ChatCompletionRequest.model_validate({**CHAT, "parallel_tool_calls": False})
    assert refusal(ChatCompletionRequest, {**CHAT, "parallel_tool_calls": "false"})["loc"] == ("parallel_tool_calls",)
