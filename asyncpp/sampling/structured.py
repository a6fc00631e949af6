"""`StructuredOutputs`: the constraint a request puts on what it generates, as vLLM names it.

One of (`SamplingParams.structured_outputs`, on the wire as a one-key map):
* `{"json": SCHEMA}`: JSON valid under a JSON schema (a map, or its JSON text);
* `{"json_object": true}`: any JSON object;
* `{"regex": "..."}`: text the regular expression matches in full;
* `{"choice": ["a", "b"]}`: exactly one of the strings;
* `{"grammar": "..."}`: text of a context-free grammar, in GBNF / EBNF (`root ::= ...`, llama.cpp's
  and xgrammar's) or Lark (`start: ...`).

Only the shape is checked here (`InvalidRequestError` naming `structured_outputs.<key>`); whether
a schema or grammar compiles is `asyncpp.structured`'s to say, before the request is scheduled.
The spec is held as text, so that it is hashable and its compiled grammar can be cached by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncpp.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
FIELD = "structured_outputs"
# Bounds on what one request may ask the grammar compiler to take in (vLLM sets none; a compile
# runs on the engine's loop and on the sampling stage).
MAX_SPEC_CHARS = 200_000
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputs:
    kind: str  # one of KINDS
    value: str  # the schema's JSON text, the regex, the choices as a JSON list, the grammar ("" for json_object)

    @staticmethod
    def from_dict(spec: Any) -> StructuredOutputs:
        """From the wire's one-key map, refusing anything else by name."""
        if isinstance(spec, StructuredOutputs):
            return spec
        if not isinstance(spec, dict):
            raise InvalidRequestError(FIELD, f"{FIELD} must be a map with one of {list(KINDS)}, got {type(spec).__name__}")
        given = [k for k, v in spec.items() if v is not None and v is not False]
        unknown = sorted(set(spec) - set(KINDS))
        if unknown:
            raise InvalidRequestError(f"{FIELD}.{unknown[0]}", f"{FIELD}.{unknown[0]}: unknown, expected one of {list(KINDS)}")
        if len(given) != 1:
            raise InvalidRequestError(FIELD, f"{FIELD} must set exactly one of {list(KINDS)}, got {sorted(given)}")
        kind = given[0]
        value = spec[kind]
        where = f"{FIELD}.{kind}"
        if kind == "json":
            value = _schema_text(value, where)
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequestError(where, f"{where} must be true, got {value!r}")
            value = ""
        elif kind == "choice":
            if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
                raise InvalidRequestError(where, f"{where} must be a list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError(where, f"{where} must hold non-empty strings only")
            value = json.dumps(value, ensure_ascii=False)
        elif not isinstance(value, str) or not value.strip():
            raise InvalidRequestError(where, f"{where} must be a non-empty string")
        if len(value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(where, f"{where} is {len(value)} characters long, at most {MAX_SPEC_CHARS}")
        return StructuredOutputs(kind, value)

    @property
    def field(self) -> str:
        """The request field it came from, for errors."""
        return f"{FIELD}.{self.kind}"

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "json":
            return {"json": json.loads(self.value)}
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind == "choice":
            return {"choice": json.loads(self.value)}
        return {self.kind: self.value}


def _schema_text(schema: Any, where: str) -> str:
    """A JSON schema as canonical JSON text (a map, or JSON text of one)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(where, f"{where} is not valid JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(where, f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)  # its order: properties are generated in it
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(where, f"{where} is not JSON: {e}") from e
