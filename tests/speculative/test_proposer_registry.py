"""The proposer registry: "none" is off, "ngram" is built in, unknown names fail naming the key, plugins register."""

from __future__ import annotations

import pytest

from asyncpp.config import ConfigError, SpeculativeConfig
from asyncpp.speculative import proposer as registry
from asyncpp.speculative.ngram import NgramProposer
from asyncpp.speculative.proposer import Proposer, create_proposer, proposer_names, register_proposer


class EchoProposer(Proposer):
    """Drafts the request's last token again; enough to tell it was built from the config it got."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self._last: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> EchoProposer:
        return cls(config.num_speculative_tokens)

    def start(self, request_id: str, token_ids: list[int]) -> None:
        self._last[request_id] = token_ids[-1]

    def extend(self, request_id: str, token_ids: list[int]) -> None:
        if request_id in self._last and token_ids:
            self._last[request_id] = token_ids[-1]

    def propose(self, request_id: str, max_num_tokens: int) -> list[int]:
        last = self._last.get(request_id)
        return [] if last is None else [last] * max(max_num_tokens, 0)

    def finish(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._last)


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by the test are undone after it."""
    monkeypatch.setattr(registry, "_PROPOSERS", dict(registry._PROPOSERS))


def test_none_means_no_proposer():
    assert create_proposer(SpeculativeConfig(method="none")) is None
    assert create_proposer(SpeculativeConfig()) is None


def test_ngram_is_built_from_the_prompt_lookup_lengths():
    proposer = create_proposer(SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_n, proposer.max_n) == (1, 3)
    proposer.start("r", [7, 1, 8, 1])  # only the 1-gram (1,) recurs: found with min_n = 1 only
    assert proposer.propose("r", 2) == [8, 1]


def test_an_unknown_method_names_the_key_and_the_known_proposers():
    with pytest.raises(ConfigError) as excinfo:
        create_proposer(SpeculativeConfig(method="eagle-typo"))
    message = str(excinfo.value)
    assert "speculative.method" in message
    assert "'eagle-typo'" in message
    assert "ngram" in message
    assert "none" in message


def test_proposer_names_lists_the_builtins():
    assert "ngram" in proposer_names()
    assert "none" not in proposer_names()


def test_a_registered_proposer_is_created_by_name(clean_registry):
    register_proposer("test-echo", EchoProposer)
    assert "test-echo" in proposer_names()
    proposer = create_proposer(SpeculativeConfig(method="test-echo", num_speculative_tokens=3))
    assert isinstance(proposer, EchoProposer)
    assert proposer.num_speculative_tokens == 3
    with pytest.raises(ConfigError, match="test-echo"):  # listed among the known names
        create_proposer(SpeculativeConfig(method="unknown"))


def test_a_name_taken_by_another_class_is_refused(clean_registry):
    register_proposer("test-echo", EchoProposer)
    with pytest.raises(ValueError, match="test-echo"):
        register_proposer("test-echo", NgramProposer)
    with pytest.raises(ValueError, match="ngram"):
        register_proposer("ngram", EchoProposer)
    assert isinstance(create_proposer(SpeculativeConfig(method="test-echo")), EchoProposer)


def test_the_same_class_again_is_a_reimport_not_a_clash(clean_registry):
    register_proposer("test-echo", EchoProposer)
    register_proposer("test-echo", EchoProposer)
    assert isinstance(create_proposer(SpeculativeConfig(method="test-echo")), EchoProposer)


def test_none_is_reserved(clean_registry):
    with pytest.raises(ValueError, match="reserved"):
        register_proposer("none", EchoProposer)


def test_a_proposer_must_implement_the_whole_interface():
    class Partial(Proposer):
        def propose(self, request_id: str, max_num_tokens: int) -> list[int]:
            return []

    with pytest.raises(TypeError):
        Partial()
