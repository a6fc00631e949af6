"""Which devices the stages run on, checked before anything is loaded.

`check_devices` turns a CUDA device that this machine cannot give (no CUDA
build of torch, no GPU, an index past the last GPU) into a `ConfigError`
naming the config key, so the launcher exits with code 2 and a sentence
instead of a stage dying with a driver traceback.
"""

from __future__ import annotations

import torch

from asyncpp.config import ConfigError, EngineConfig


def check_devices(config: EngineConfig) -> tuple[str, ...]:
    """The stages' devices, each one usable here; else a `ConfigError`."""
    devices = config.stage_devices
    key = "parallel.devices" if config.parallel.devices else "model.device"
    for device in devices:
        if device == "cpu":
            continue
        if not torch.cuda.is_available():
            reason = (
                f"this torch ({torch.__version__}) is built without CUDA"
                if torch.version.cuda is None
                else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
            )
            raise ConfigError(f"{key} asks for {device!r} but {reason}; use device = \"cpu\"")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{key} asks for {device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return devices


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def indexed_device(device: str | torch.device) -> torch.device:
    """`cuda` -> `cuda:<current>`: CUDA calls that take a device want its index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
