"""`GrammarCompiler`: each kind compiles into a matcher of the right language, once per spec; a
spec that does not compile is an `InvalidRequestError` naming its field, remembered as such."""

from __future__ import annotations

import json

import pytest

from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.structured import StructuredOutputs
from asyncpp.structured import compiler as compiler_module

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
    "required": ["n", "tags"],
    "additionalProperties": False,
}


def spec(**kind) -> StructuredOutputs:
    return StructuredOutputs.from_dict(kind)


def accepts(compiler, structured: StructuredOutputs, text: str) -> bool:
    """Whether the matcher takes `text` (as the tokenizer spells it) and may end there."""
    matcher = compiler.matcher(structured)
    tokens = compiler.lltokenizer.tokenize_bytes(text.encode())
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize(
    "structured, good, bad",
    [
        (spec(json=SCHEMA), '{"n": 3, "tags": ["x"]}', '{"n": "3", "tags": []}'),
        (spec(json=SCHEMA), '{"n":-1,"tags":[]}', '{"n": 1, "tags": ["z"]}'),
        (spec(json_object=True), '{"any": [1, {"b": null}]}', "[1, 2]"),
        (spec(regex=r"(yes|no)-\d{2}"), "no-42", "no-4"),
        (spec(choice=["red", "green é"]), "green é", "blue"),
        (spec(grammar='root ::= "n=" num\nnum ::= [0-9]+'), "n=12", "n="),
        (spec(grammar='start: "n=" NUM\nNUM: /[0-9]+/'), "n=7", "m=7"),  # Lark
    ],
)
def test_each_kind_compiles_to_its_language(compiler, structured, good, bad):
    assert accepts(compiler, structured, good)
    assert not accepts(compiler, structured, bad)


@pytest.mark.parametrize(
    "structured, field",
    [
        (spec(json={"type": "nope"}), "structured_outputs.json"),
        (spec(json={"type": "object", "properties": {"a": {"$ref": "#/missing"}}}), "structured_outputs.json"),
        (spec(regex="[a-z"), "structured_outputs.regex"),
        (spec(grammar="root ::= foo"), "structured_outputs.grammar"),
        (spec(grammar='root ::= ("a"'), "structured_outputs.grammar"),
        (spec(grammar='foo ::= "a"'), "structured_outputs.grammar"),  # no root rule
        (spec(grammar="start: foo"), "structured_outputs.grammar"),
    ],
)
def test_what_does_not_compile_is_refused_by_field_and_remembered(compiler, structured, field):
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match=f"^{field} does not compile: .") as info:
            compiler.check(structured)
        assert info.value.field == field
    assert (compiler.num_compiled, compiler.num_cache_hits) == (1, 1)


def test_a_spec_is_compiled_once_and_each_request_gets_its_own_matcher(compiler):
    structured = spec(choice=["ab", "ba"])
    first, second = compiler.matcher(structured), compiler.matcher(spec(choice=["ab", "ba"]))
    assert compiler.stats()["grammar_num_compiled"] == 1 and compiler.stats()["grammar_num_cache_hits"] == 1
    assert compiler.stats()["grammar_compile_s_max"] > 0
    a = compiler.lltokenizer.tokenize_bytes(b"a")
    assert first.consume_tokens(a)
    assert second.compute_logit_bias() == compiler.matcher(structured).compute_logit_bias() != first.compute_logit_bias()


def test_the_cache_keeps_the_latest_specs(compiler, monkeypatch):
    monkeypatch.setattr(compiler_module, "MAX_CACHED", 2)
    for c in ("a", "b", "c"):
        compiler.check(spec(choice=[c]))
    compiler.check(spec(choice=["c"]))
    compiler.check(spec(choice=["a"]))  # dropped: compiled again
    assert (compiler.num_compiled, compiler.num_cache_hits) == (4, 1)


def test_eos_is_allowed_only_once_the_grammar_accepts(compiler, tiny_tokenizer):
    matcher = compiler.matcher(spec(regex="ab?"))
    eos = tiny_tokenizer.eos_token_id
    assert compiler.eos_token_id == eos
    assert matcher.compute_logit_bias()[eos] == 0
    assert matcher.consume_tokens(compiler.lltokenizer.tokenize_bytes(b"a"))
    assert matcher.compute_logit_bias()[eos] != 0  # "a" is a whole answer, "ab" another
    assert matcher.consume_tokens(compiler.lltokenizer.tokenize_bytes(b"b"))
    allowed = [i for i, v in enumerate(matcher.compute_logit_bias()) if v]
    assert allowed == [eos]  # nothing else may follow: the answer ends


def test_a_choice_is_a_json_list_of_literals(compiler):
    text = compiler_module.grammar_text(spec(choice=['say "hi"', "a|b"]))
    assert json.dumps('say "hi"') in text and '"a|b"' in text
    assert accepts(compiler, spec(choice=['say "hi"', "a|b"]), 'say "hi"')
    assert not accepts(compiler, spec(choice=['say "hi"', "a|b"]), "a")


def test_stats_count_compiles_and_cache_hits(compiler):
    assert compiler.stats() == {"grammar_num_compiled": 0, "grammar_num_cache_hits": 0, "grammar_compile_s_max": 0.0}
    structured = spec(regex="a+")
    for _ in range(3):
        compiler.check(structured)
    stats = compiler.stats()
    assert stats["grammar_num_compiled"] == 1 and stats["grammar_num_cache_hits"] == 2
    assert 0.0 < stats["grammar_compile_s_max"] < 5.0


def test_logits_wider_than_the_vocabulary_never_allow_the_padding(tiny_tokenizer):
    from asyncpp.structured.compiler import GrammarCompiler

    padded = GrammarCompiler(tiny_tokenizer, tiny_tokenizer.vocab_size + 64)
    assert padded.lltokenizer.vocab_size == tiny_tokenizer.vocab_size + 64
    allowed = padded.matcher(spec(json_object=True)).compute_logit_bias()
    assert len(allowed) >= tiny_tokenizer.vocab_size + 64 and not any(allowed[tiny_tokenizer.vocab_size :])
