"""`StructuredOutputs`: the shapes a request may ask for, refused by name otherwise, and carried
unchanged through `SamplingParams` and the stages' wire."""

from __future__ import annotations

import pytest

from asyncpp.core.plan import NewRequestData, StepPlan
from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.structured import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputs
from asyncpp.wire.codec import decode, encode
import asyncpp.wire.stage_msgs  # noqa: F401  (registers the plan's tag)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}, "required": ["b"]}


@pytest.mark.parametrize(
    "spec, kind, value",
    [
        ({"json": SCHEMA}, "json", '{"type":"object","properties":{"b":{"type":"integer"},"a":{"enum":["x","y"]}},"required":["b"]}'),
        ({"json": '{"type": "string"}'}, "json", '{"type":"string"}'),
        ({"json_object": True}, "json_object", ""),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"choice": ["yes", "no", "été"]}, "choice", '["yes", "no", "été"]'),
        ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
        ({"json": SCHEMA, "regex": None, "json_object": False}, "json", None),  # unset keys as vLLM sends them
    ],
)
def test_each_kind_is_taken_and_round_trips(spec, kind, value):
    parsed = StructuredOutputs.from_dict(spec)
    assert parsed.kind == kind and parsed.field == f"structured_outputs.{kind}"
    if value is not None:
        assert parsed.value == value  # the schema's own key order: its properties are generated in it
    assert StructuredOutputs.from_dict(parsed.to_dict()) == parsed
    assert StructuredOutputs.from_dict(parsed) is parsed


@pytest.mark.parametrize(
    "spec, field, message",
    [
        ("json", "structured_outputs", "must be a map"),
        ({}, "structured_outputs", "exactly one of"),
        ({"json": SCHEMA, "regex": "a"}, "structured_outputs", r"exactly one of .* got \['json', 'regex'\]"),
        ({"xml": "<a/>"}, "structured_outputs.xml", "unknown"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json", "must be a JSON schema"),
        ({"json": {"x": float("nan")}}, "structured_outputs.json", "not JSON"),
        ({"json_object": "yes"}, "structured_outputs.json_object", "must be true"),
        ({"choice": []}, "structured_outputs.choice", "list of 1 to"),
        ({"choice": "yes"}, "structured_outputs.choice", "list of 1 to"),
        ({"choice": ["a"] * (MAX_CHOICES + 1)}, "structured_outputs.choice", "list of 1 to"),
        ({"choice": ["a", ""]}, "structured_outputs.choice", "non-empty strings"),
        ({"choice": ["a", 3]}, "structured_outputs.choice", "non-empty strings"),
        ({"regex": ""}, "structured_outputs.regex", "non-empty string"),
        ({"regex": 5}, "structured_outputs.regex", "non-empty string"),
        ({"grammar": "  \n"}, "structured_outputs.grammar", "non-empty string"),
        ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "structured_outputs.regex", "characters long"),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(spec, field, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        StructuredOutputs.from_dict(spec)
    assert info.value.field == field


def test_sampling_params_carry_it_through_dicts_and_the_stages_wire():
    params = SamplingParams.from_dict({"max_tokens": 4, "structured_outputs": {"choice": ["a", "b"]}})
    assert params.structured_outputs == StructuredOutputs("choice", '["a", "b"]')
    assert params.to_dict()["structured_outputs"] == {"choice": ["a", "b"]}
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams().to_dict()["structured_outputs"] is None
    plan = StepPlan(1, [], new_requests=[NewRequestData("r", [1, 2], [], params)])
    assert decode(encode(plan)).new_requests[0].sampling_params == params
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex"):
        SamplingParams(structured_outputs={"regex": ""})


def test_the_limits_themselves_are_allowed_and_json_goes_back_as_a_schema():
    assert StructuredOutputs.from_dict({"choice": ["a"] * MAX_CHOICES}).kind == "choice"
    assert StructuredOutputs.from_dict({"regex": "a" * MAX_SPEC_CHARS}).kind == "regex"
    assert StructuredOutputs.from_dict({"json": SCHEMA}).to_dict() == {"json": SCHEMA}  # an object, as vLLM's field
