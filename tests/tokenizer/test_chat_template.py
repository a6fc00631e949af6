"""Chat template rendering: message validation, helpers, and errors as ValueError."""

from __future__ import annotations

import pytest

from asyncpp.tokenizer import Tokenizer
from asyncpp.tokenizer.chat_template import ChatTemplate


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.byte_level(260)


@pytest.mark.parametrize("messages, problem", [
    ("hello", "messages must be a list of dicts, got str"),
    ({"role": "user"}, "messages must be a list of dicts, got dict"),
    ([], "messages must not be empty"),
    (["hi"], r"messages\[0\] must be a dict, got str"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\] has no 'role'"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a str, got NoneType"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\['role'\] must be a str, got int"),
])
def test_bad_messages_raise_value_error_naming_problem(tok: Tokenizer, messages, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        tok.apply_chat_template(messages)


def test_no_template_raises(tmp_path, tok: Tokenizer) -> None:
    tok.save_hf(tmp_path)
    config = (tmp_path / "tokenizer_config.json")
    config.write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    bare = Tokenizer.from_hf_dir(tmp_path)
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_helpers_and_variables() -> None:
    source = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
              "{{ raise_exception('tool messages unsupported') }}{% endif %}"
              "{{ bos_token }}{{ m | tojson }}{{ eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}>{% endif %}")
    template = ChatTemplate(source, bos_token="<s>", eos_token=None)
    rendered = template.render([{"role": "user", "content": "<b>é</b>", "name": "x"}],
                               add_generation_prompt=True)
    # Plain JSON (no HTML escaping, no ASCII escaping); extra keys pass through;
    # an undefined eos_token renders as "".
    assert rendered == '<s>{"role": "user", "content": "<b>é</b>", "name": "x"}>'
    with pytest.raises(ValueError, match="tool messages unsupported"):
        template.render([{"role": "tool", "content": "x"}])


def test_template_blocks_trimmed_like_transformers() -> None:
    # trim_blocks/lstrip_blocks: block tags do not leave their newlines and indentation.
    source = "{% for m in messages %}\n    {{ m['content'] }}\n{% endfor %}\n"
    assert ChatTemplate(source, bos_token=None, eos_token=None).render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "    a\n    b\n"


def test_sandbox_and_syntax_errors_become_value_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", bos_token=None, eos_token=None)
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", bos_token=None, eos_token=None)
    with pytest.raises(ValueError, match="rejected"):
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{{ messages.append(1) }}", bos_token=None, eos_token=None)
    with pytest.raises(ValueError, match="rejected"):
        mutate.render([{"role": "user", "content": "x"}])
