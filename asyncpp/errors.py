"""Errors users see. Each names what was wrong so a client can fix its request."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request was rejected before touching engine state; `field` names the culprit.

    `message` is the reason as given; `str()` puts the field in front of it unless the
    message already starts with the field's name ("max_tokens must be >= 1"), so that
    a field is never named twice in a row."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field
        self.message = message


class EngineDeadError(RuntimeError):
    """The engine (or one of its stages) died; in-flight requests cannot finish."""
