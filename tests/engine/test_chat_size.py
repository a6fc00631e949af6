"""`InputProcessor.check_chat_size`: a chat with more messages than `max_model_len` tokens can hold is
refused by their number before its template runs, and a chat that fits never is (the template is
probed for which roles cost a token a message)."""

from __future__ import annotations

import pytest

from asyncpp.engine.input_processor import PROBED_ROLES, InputProcessor
from asyncpp.errors import InvalidRequestError
from asyncpp.tokenizer.byte_level import build_byte_level
from asyncpp.tokenizer.tokenizer import Tokenizer

MAX_MODEL_LEN = 16
ONE_BYTE_EACH = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"  # an empty message: exactly one token
SKIPS_EMPTY = "{% for m in messages %}{% if m['content'] %}{{ m['content'] }}|{% endif %}{% endfor %}"
REFUSES_TOOL = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{{ m['content'] }}|{% endfor %}")  # fmt: skip
SKIPS_DEVELOPER = "{% for m in messages %}{% if m['role'] != 'developer' %}{{ m['content'] }}|{% endif %}{% endfor %}"


class Recording(Tokenizer):
    """A byte-level tokenizer with this chat template that records the size of every chat it renders."""

    def __init__(self, template: str | None) -> None:
        parts = build_byte_level(320)
        super().__init__(parts.backend, bos_token_id=parts.bos_token_id, eos_token_id=parts.eos_token_id,
                         chat_template=template)  # fmt: skip
        self.rendered: list[int] = []

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.rendered.append(len(messages))
        return super().apply_chat_template(messages, add_generation_prompt)


def processor(template: str | None) -> InputProcessor:
    return InputProcessor(Recording(template), 320, MAX_MODEL_LEN)


def empty(num: int, role: str = "user") -> list[dict[str, str]]:
    return [{"role": role, "content": ""} for _ in range(num)]


def test_one_message_past_what_fits_is_refused_before_the_template_runs():
    p = processor(ONE_BYTE_EACH)
    assert p.costly_roles() == frozenset(PROBED_ROLES)
    probes = len(p.tokenizer.rendered)
    assert p.tokenize(empty(MAX_MODEL_LEN - 1)) == [ord("|") + 3] * (MAX_MODEL_LEN - 1)  # fits, with 1 token to answer
    p.check_lengths(MAX_MODEL_LEN - 1, 1)
    with pytest.raises(InvalidRequestError, match=r"messages \(17\) are more than max_model_len 16") as info:
        p.tokenize(empty(MAX_MODEL_LEN + 1))
    assert info.value.field == "messages"
    assert p.tokenizer.rendered[probes:] == [MAX_MODEL_LEN - 1]  # the refused chat was never rendered
    with pytest.raises(InvalidRequestError, match="messages"):
        p.tokenize(empty(1_000_000))
    assert max(p.tokenizer.rendered[probes:]) < MAX_MODEL_LEN
    p.check_chat_size(empty(MAX_MODEL_LEN))  # exactly what fits: not refused by number
    p.check_chat_size(empty(MAX_MODEL_LEN // 2 + 1))


def test_the_chatml_template_costs_every_role_a_token():
    assert processor(build_byte_level(320).chat_template).costly_roles() == frozenset(PROBED_ROLES)


def test_messages_a_template_drops_are_not_counted():
    p = processor(SKIPS_EMPTY)
    assert p.costly_roles() == frozenset()
    assert p.tokenize(empty(1000) + [{"role": "user", "content": "hi"}]) == [ord(c) + 3 for c in "hi|"]


def test_a_role_the_template_refuses_is_not_counted():
    p = processor(REFUSES_TOOL)
    assert p.costly_roles() == frozenset(PROBED_ROLES) - {"tool"}
    p.check_chat_size(empty(MAX_MODEL_LEN + 1, "tool"))  # not refused by their number (the template refuses them)
    with pytest.raises(InvalidRequestError, match="more than max_model_len"):
        p.check_chat_size(empty(MAX_MODEL_LEN // 2, "tool") + empty(MAX_MODEL_LEN + 1))


def test_role_aliases_count_a_message_under_the_role_the_template_sees():
    p = processor(SKIPS_DEVELOPER)
    assert "developer" not in p.costly_roles() and "system" in p.costly_roles()
    p.check_chat_size(empty(MAX_MODEL_LEN + 1, "developer"))
    with pytest.raises(InvalidRequestError, match="more than max_model_len"):
        p.check_chat_size(empty(MAX_MODEL_LEN + 1, "developer"), {"developer": "system"})


def test_without_a_template_nothing_is_refused_by_number():
    p = processor(None)
    assert p.costly_roles() == frozenset()
    p.check_chat_size(empty(1000))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        p.tokenize(empty(1000))
