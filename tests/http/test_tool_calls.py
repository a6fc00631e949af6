"""`http.tool_calls` on its own: tools and tool_choice parsed (bad ones refused by field), the schema
an answer is generated under, and answers turned into `tool_calls`, whole or streamed."""

from __future__ import annotations

import json

import pytest

from asyncpp.errors import InvalidRequestError
from asyncpp.http.formatter import Formatter
from asyncpp.http.tool_calls import ToolCallStream, ToolRequest
from asyncpp.wire.client_msgs import RequestDelta

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "time"}}
NAMED = {"type": "function", "function": {"name": "weather"}}


def parse(tool_choice=None, tools=(WEATHER, TIME), parallel=None) -> ToolRequest | None:
    return ToolRequest.parse(list(tools) if tools is not None else None, tool_choice, parallel)


def test_choices_and_the_schema_each_is_generated_under():
    assert parse(tools=None) is None and parse("none", tools=[]) is None and parse("auto", tools=None) is None
    assert parse().choice == "auto" and parse().structured_outputs() is None
    assert parse("none").structured_outputs() is None
    named = parse(NAMED)
    assert (named.choice, named.named, named.field) == ("named", "weather", "tools[0].function.parameters")
    assert named.structured_outputs() == {"json": WEATHER["function"]["parameters"]}
    required = parse("required").structured_outputs()["json"]
    assert required["minItems"] == 1 and "maxItems" not in required
    names = [item["properties"]["name"]["const"] for item in required["items"]["anyOf"]]
    assert names == ["weather", "time"]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}  # no parameters: any object
    assert parse("required", parallel=False).structured_outputs()["json"]["maxItems"] == 1
    assert parse("required").field == "tools" and parse("required").is_forced and not parse("auto").is_forced


@pytest.mark.parametrize(
    "tools, tool_choice, field, words",
    [
        (None, "required", "tool_choice", "needs tools"),
        ([], {"type": "function", "function": {"name": "f"}}, "tool_choice", "needs tools"),
        ({"a": 1}, None, "tools", "must be a list"),
        ([{"type": "code_interpreter"}], None, "tools[0].type", '"function"'),
        ([WEATHER, {"type": "function"}], None, "tools[1].function", "an object"),
        ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name", "1-64"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name", "1-64"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0].function.description", "string"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools[0].function.parameters", "object"),
        ([WEATHER, WEATHER], None, "tools[1].function.name", "twice"),
        ([WEATHER], "sometimes", "tool_choice", "must be"),
        ([WEATHER], {"type": "function", "function": {"name": "time"}}, "tool_choice", "not in tools"),
        ([WEATHER], {"type": "function"}, "tool_choice", "not in tools"),
    ],
)
def test_bad_tools_and_choices_are_refused_by_field(tools, tool_choice, field, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        ToolRequest.parse(tools, tool_choice, None)
    assert info.value.field == field


def test_answers_become_calls():
    [call], content = parse(NAMED).calls('{"city": "Paris"}')
    assert content is None and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    calls, content = parse("required").calls('[{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"city": "Oslo"}}]')
    assert [c["function"] for c in calls] == [{"name": "time", "arguments": "{}"}, {"name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert len({c["id"] for c in calls}) == 2 and content is None
    assert parse("required").calls('[{"name": "ti') == ([], '[{"name": "ti')  # cut short: no call
    auto = parse()
    assert auto.calls("Hello there.") == ([], "Hello there.")
    text = 'Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    calls, content = auto.calls(text)
    assert content == "Let me look." and [c["function"] for c in calls] == [{"name": "weather", "arguments": '{"city": "Rome"}'}]
    assert auto.calls("<tool_call>not json</tool_call>") == ([], "<tool_call>not json</tool_call>")
    assert auto.calls('<tool_call>{"name": "elsewhere"}</tool_call>')[0] == []  # not a tool of the request
    assert parse("none").calls(text) == ([], text)


def stream(tools: ToolRequest, pieces: list[str]) -> list[dict]:
    out = ToolCallStream(tools)
    return [d for i, p in enumerate(pieces) for d in out.deltas(p, i == 0, i == len(pieces) - 1)]


def test_a_named_call_streams_its_arguments_as_they_come():
    deltas = stream(parse(NAMED), ['{"ci', 'ty": "Par', 'is"}'])
    first = deltas[0]
    assert first["role"] == "assistant" and first["content"] is None
    [call] = first["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"ci'} and call["type"] == "function"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])


def test_an_auto_answer_streams_its_content_and_holds_what_may_be_a_call():
    deltas = stream(parse(), ["Hi <", "tool", "_call>", '{"name": "time", "arguments": {}}', "</tool_call>"])
    assert deltas[0] == {"role": "assistant", "content": "Hi "}
    assert [d for d in deltas[1:] if "content" in d] == []
    [call] = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert call["index"] == 0 and call["function"] == {"name": "time", "arguments": "{}"}
    plain = stream(parse(), ["a < b", " and c", ""])
    assert "".join(d.get("content", "") for d in plain) == "a < b and c"  # a "<" that began no call is sent


def test_the_formatter_gives_tool_calls_and_their_finish_reason():
    def delta(text: str, finished=False, reason=None) -> RequestDelta:
        return RequestDelta("r", text, [1], finished, reason)

    formatter = Formatter("chatcmpl-1", 0, "m", True, [], [], parse(NAMED))
    chunks = formatter.chunks(delta('{"city"', ), is_first=True) + formatter.chunks(delta(': "X"}', True, "stop"))
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "tool_calls"]
    formatter = Formatter("chatcmpl-2", 0, "m", True, [], [], parse("required"))
    chunks = formatter.chunks(delta("[", ), is_first=True) + formatter.chunks(delta('{"name": "time", "parameters": {}}]', True, "stop"))
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert [c["function"]["name"] for c in calls] == ["time"] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = Formatter("chatcmpl-3", 0, "m", True, [], [], parse("required")).full(
        [delta('[{"name": "weather", "parameters": {"city": "A"}}]', True, "stop")], _Times()
    )["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] is None
    assert json.loads(message["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "A"}
    truncated = Formatter("chatcmpl-4", 0, "m", True, [], [], parse("required")).full([delta("[{", True, "length")], _Times())
    assert truncated["choices"][0]["finish_reason"] == "length" and truncated["choices"][0]["message"]["content"] == "[{"


class _Times:
    num_prompt_tokens = 3
    num_output_tokens = 2


def test_the_required_schema_takes_only_calls_of_the_tools():
    jsonschema = pytest.importorskip("jsonschema")
    schema = parse("required").structured_outputs()["json"]
    ok = [{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in (
        [],  # at least one call
        ["time"],  # each an object
        {"name": "time", "parameters": {}},  # an array of calls, not one
        [{"name": "time"}],  # parameters required
        [{"parameters": {}}],  # name required
        [{"name": "time", "parameters": {}, "extra": 1}],  # nothing else
        [{"name": "elsewhere", "parameters": {}}],  # one of the tools
        [{"name": "weather", "parameters": []}],  # an object
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_calls_keep_non_ascii_arguments_and_take_parameters_as_arguments():
    [call], _ = parse("required").calls('[{"name": "weather", "parameters": {"city": "Zürich"}}]')
    assert call["function"]["arguments"] == '{"city": "Zürich"}'
    assert len(call["id"]) == len("call_") + 24
    text = (
        '<tool_call>{"oops": 1}</tool_call> '
        '<tool_call>{"name": "weather", "parameters": {"city": "Zürich"}}</tool_call>'
        '<tool_call>{"name": "time"}</tool_call>'
    )
    calls, content = parse().calls(text)  # a block that is no call stays content; the calls after it count
    assert [c["function"] for c in calls] == [
        {"name": "weather", "arguments": '{"city": "Zürich"}'},
        {"name": "time", "arguments": "{}"},
    ]
    assert content == '<tool_call>{"oops": 1}</tool_call>'


def test_bad_choices_are_quoted_short_in_the_error():
    with pytest.raises(InvalidRequestError) as info:
        parse("x" * 200)
    assert "'xxxxx" in info.value.message and info.value.message.endswith("...") and len(info.value.message) < 160
    with pytest.raises(InvalidRequestError, match=r"got \{\"type\": \"tool\"\}"):
        parse({"type": "tool"}, tools=[WEATHER])
    with pytest.raises(InvalidRequestError, match="got 'always'"):
        parse("always")
    with pytest.raises(InvalidRequestError, match="got str"):
        ToolRequest.parse("weather", None, None)
    with pytest.raises(InvalidRequestError, match="tool_choice 'required' needs tools"):
        ToolRequest.parse(None, "required", None)


def test_a_named_stream_starts_with_the_call_s_identity_and_no_content():
    deltas = stream(parse(NAMED), ['{"city"', ': "Rome"}'])
    first, second = deltas[0]["tool_calls"][0], deltas[1]["tool_calls"][0]
    assert first["index"] == 0 and second["index"] == 0
    assert first["id"].startswith("call_") and len(first["id"]) == len("call_") + 24 and first["type"] == "function"
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    assert "role" not in deltas[1] and "content" not in deltas[1]


def test_an_auto_stream_holds_only_what_may_begin_a_call_and_sends_the_rest_at_the_end():
    held = stream(parse(), ["<tool", "_call>"])
    assert held[0] == {"role": "assistant"}  # nothing to send yet: the role alone
    assert "".join(d.get("content", "") for d in held) == "<tool_call>"  # no call after all: content
    tail = stream(parse(), ["x <", "tool"])
    assert "".join(d.get("content", "") for d in tail) == "x <tool"
    both = '{"name": "time", "arguments": {}}'
    two = stream(parse(), [f"a <tool_call>{both}</tool_call> b <tool_call>{both}</tool_call>"])
    assert two[0]["content"] == "a " and [d["tool_calls"][0]["index"] for d in two if "tool_calls" in d] == [0, 1]


