"""Activation hand-off between pipeline stages, behind a small registry."""

from asyncpp.device import is_cuda
from asyncpp.transport import cuda_ipc as _cuda_ipc  # noqa: F401  (registers "cuda_ipc")
from asyncpp.transport import nixl as _nixl  # noqa: F401  (registers "nixl")
from asyncpp.transport import shm as _shm  # noqa: F401  (registers "shm")
from asyncpp.transport.base import TRANSPORTS, ActivationError, ActivationNotice, RingSpec, get_transport


def transport_for(device: str) -> str:
    """The transport between stages on `device`: CUDA IPC between GPUs, shared memory on CPU."""
    return "cuda_ipc" if is_cuda(device) else "shm"


__all__ = ["ActivationError", "ActivationNotice", "RingSpec", "TRANSPORTS", "get_transport", "transport_for"]
