"""Activation hand-off between pipeline stages, behind a small registry."""

from asyncpp.transport import shm as _shm  # noqa: F401  (registers "shm")
from asyncpp.transport.base import TRANSPORTS, ActivationError, ActivationNotice, RingSpec, get_transport

__all__ = ["ActivationError", "ActivationNotice", "RingSpec", "TRANSPORTS", "get_transport"]
