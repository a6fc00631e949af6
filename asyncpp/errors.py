"""Errors users see. Each names what was wrong so a client can fix its request."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request was rejected before touching engine state; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineDeadError(RuntimeError):
    """The engine (or one of its stages) died; in-flight requests cannot finish."""
