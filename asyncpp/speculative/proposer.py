"""Proposers by name: the `Proposer` interface, a small registry, and the one place that turns config into a proposer.

A proposer lives on the pipeline's last stage, next to the sampler, and keeps
state per request, keyed by request id. The model runner drives it:

* `start(request_id, token_ids)` when a request starts sampling, or resumes
  after preemption: token_ids = prompt + outputs so far; replaces any state.
* `extend(request_id, token_ids)` with the tokens accepted this step, in order.
* `propose(request_id, max_num_tokens)` for up to max_num_tokens drafts to
  follow the request's current tokens.
* `finish(request_id)` when the request finishes or is aborted (a preempted
  request may instead be `start`ed again on resume, which replaces its state).

Drafts are unverified guesses: the next step verifies them (the rejection
sampler) and only what it accepts comes back through `extend`. A draft is
never part of the request's tokens, and a proposer never appends its own
drafts to its state.

Built-in proposers are registered lazily by module; an out-of-tree one (a
test's, a plugin's) registers itself with `register_proposer` when its module
is imported. An unknown name fails at start-up naming `speculative.method`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from asyncpp.config import ConfigError, SpeculativeConfig

_PROPOSERS: dict[str, type[Proposer]] = {}
_BUILTIN_MODULES = {
    "ngram": "asyncpp.speculative.ngram",
}


class Proposer(ABC):
    """Drafts tokens for each request from state the runner keeps current with `start` / `extend`.

    Every method is called on the last stage, every step, for every sampling
    request, so each must cost a few dict operations per request, never a
    scan of the request's history. An unknown request id is not an error
    (the request may have finished or never drafted): `extend` and `finish`
    ignore it, `propose` returns [].
    """

    @classmethod
    @abstractmethod
    def from_config(cls, config: SpeculativeConfig) -> Proposer:
        """The proposer for `[speculative]`; the constructor itself takes plain values."""

    @abstractmethod
    def start(self, request_id: str, token_ids: list[int]) -> None:
        """A new request, or one resumed after preemption: rebuild its state from token_ids (prompt + outputs)."""

    @abstractmethod
    def extend(self, request_id: str, token_ids: list[int]) -> None:
        """Append the tokens accepted this step, in order (verified tokens only, never drafts)."""

    @abstractmethod
    def propose(self, request_id: str, max_num_tokens: int) -> list[int]:
        """Up to max_num_tokens unverified draft tokens to follow the request's current tokens; [] for none.

        Does not change the state: the drafts count only once verified and passed back to `extend`.
        """

    @abstractmethod
    def finish(self, request_id: str) -> None:
        """Drop the request's state."""

    @property
    @abstractmethod
    def num_requests(self) -> int:
        """Requests with state held now."""


def register_proposer(name: str, proposer_cls: type[Proposer]) -> None:
    if name == "none":
        raise ValueError("'none' is reserved: it means no proposer")
    existing = _PROPOSERS.get(name)
    # The same class again is a module imported twice (a plugin re-imported), not a clash.
    if existing is not None and existing is not proposer_cls:
        raise ValueError(f"proposer {name!r} registered twice ({existing.__qualname__}, {proposer_cls.__qualname__})")
    _PROPOSERS[name] = proposer_cls


def proposer_names() -> list[str]:
    """Every proposer name `speculative.method` accepts besides "none", registered or built in."""
    return sorted({*_BUILTIN_MODULES, *_PROPOSERS})


def proposer_class(name: str) -> type[Proposer]:
    if name not in _PROPOSERS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _PROPOSERS:
        known = ["none", *proposer_names()]
        raise ConfigError(f"speculative.method: unknown proposer {name!r} (known: {', '.join(known)})")
    return _PROPOSERS[name]


def create_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The proposer `speculative.method` names; None for "none" (speculative decoding off)."""
    if not config.is_enabled:
        return None
    return proposer_class(config.method).from_config(config)
