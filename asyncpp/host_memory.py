"""Whether a deployment's weights and KV caches can fit in this host's memory, checked before anything loads.

Every engine holds one copy of the model's weights (its stages split the
layers) and every stage its KV cache (`cache.kv_cache_memory_mb`), so a
data-parallel deployment holds the weights once per replica, plus once for
its long-prompt engine: three times in the default deployment. A model that
fits once may not fit three times, and a stage the kernel kills for memory
halfway through loading says nothing about why.

`check_host_memory` adds up a floor of what the CPU engines will hold and
compares it with the host's available memory (`MemAvailable` in
`/proc/meminfo`); over it is a `ConfigError` that gives both figures and what
to change, so the launcher exits with code 2 before any process starts. The
floor never overstates the need, so the check refuses only deployments that
cannot fit:
- the weights: the model's linear and embedding parameters at the fewest
  bytes the configured dtype can take ("auto": 2), or the file's own tensor
  bytes where fewer and the weights may stay in the file's format (a GGUF
  file's blocks, `model.weight_format` "auto" or "native"); norms, buffers,
  the packed head's second copy and each process's Python and torch (a few
  hundred MB) are left out;
- the KV caches: `cache.kv_cache_memory_mb` per stage
  (`cache.num_kv_blocks_override` set: none counted).
CUDA stages (their weights live on the GPU), Ray's stages (on other hosts)
and hosts without `/proc/meminfo` are not checked.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncpp.config import ConfigError, EngineConfig
from asyncpp.model.arch import ModelArch
from asyncpp.weights.registry import stored_bytes

MIB = 1024 * 1024
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}  # every model.dtype; auto: its fewest


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's available memory (`MemAvailable`), None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "MemAvailable":
                    return int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def weights_floor_bytes(config: EngineConfig, arch: ModelArch) -> int:
    """The fewest bytes one engine's copy of the weights takes (see the module docstring)."""
    model = config.model
    params = arch.num_layers * arch.layer_params + arch.vocab_size * arch.hidden_size
    floor = params * _DTYPE_BYTES[model.dtype]
    stored = stored_bytes(model.source, model.path_or_none) if model.weight_format != "float" else None
    return floor if stored is None else min(floor, stored)


def check_host_memory(
    config: EngineConfig, arch: ModelArch, engine_stages: Sequence[int], available: int | None = None
) -> None:
    """`ConfigError` if engines of `engine_stages` stages each (one entry per engine, the long-prompt
    engine included) cannot fit in `available` bytes (None: the host's `MemAvailable`)."""
    if config.parallel.backend != "local" or any(device != "cpu" for device in config.stage_devices):
        return
    available = mem_available_bytes() if available is None else available
    if available is None:
        return
    weights, copies = weights_floor_bytes(config, arch), len(engine_stages)
    kv = 0 if config.cache.num_kv_blocks_override else config.cache.kv_cache_memory_mb * MIB
    need = copies * weights + sum(engine_stages) * kv
    if need <= available:
        return
    what = f"{copies} copies of the weights (one per engine)" if copies > 1 else "the weights"
    hint = (
        "serve one engine instead (`asyncpp serve -dp 1 -pp 2`: parallel.dp_size = 1, pp_size = 2), "
        "or lower cache.kv_cache_memory_mb"
        if copies > 1
        else "lower cache.kv_cache_memory_mb, or serve a smaller model"
    )
    raise ConfigError(
        f"this deployment needs at least {need / MIB:,.0f} MiB of memory and {available / MIB:,.0f} MiB are "
        f"available: {what}, at least {weights / MIB:,.0f} MiB each, and {sum(engine_stages)} stages' KV caches of "
        f"{kv / MIB:,.0f} MiB each (cache.kv_cache_memory_mb); {hint}"
    )
