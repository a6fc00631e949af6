"""What an engine resolves before it serves, in either runtime: its capacity (layer ranges per
stage, KV blocks, the shift windows), the KV connector's context, speculative decoding's draft
policy, and the hand-over of every stage's KV handshake to the scheduler connector. Each fails
start-up with an error naming the config key at fault.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from asyncpp.config import ConfigError, EngineConfig, SpeculativeConfig
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorScheduler
from asyncpp.kv_transfer.handshake import KVHandshakeMetadata
from asyncpp.kv_transfer.registry import connector_context
from asyncpp.model.arch import ModelArch
from asyncpp.model.split import compute_layer_ranges, head_cost_in_layers, held_ranges, shift_windows
from asyncpp.speculative.policy import DraftPolicy
from asyncpp.speculative.proposer import create_proposer
from asyncpp.worker.shared_kv import SharedKVSpec, shared_kv_specs
from asyncpp.worker.stage import stage_num_blocks, torch_dtype


@dataclass(frozen=True)
class EngineCapacity:
    """Values found at start-up, kept apart from the frozen config."""

    num_blocks: int
    block_size: int
    max_model_len: int
    layer_ranges: list[tuple[int, int]]  # the static split
    # Per stage boundary, the (lowest, highest) start of the later stage (`parallel.shift_layers`).
    shift_windows: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def held_ranges(self) -> list[tuple[int, int]]:
        """The layers each stage loads: its own, plus the windows around it."""
        return held_ranges(self.layer_ranges, self.shift_windows) if self.shift_windows else self.layer_ranges

    @property
    def is_shifting(self) -> bool:
        return any(hi > lo for lo, hi in self.shift_windows)

    def shared_kv_specs(self, arch: ModelArch, dtype: str, names: list[str]) -> list[SharedKVSpec]:
        """The shared KV caches of the shift windows (one name per window), sized for `num_blocks`."""
        num_slots = self.num_blocks * self.block_size
        return shared_kv_specs(self.shift_windows, names, num_slots, arch.num_kv_heads, arch.head_dim, dtype)


def resolve_capacity(config: EngineConfig, arch: ModelArch, dtype: str) -> EngineCapacity:
    """Layer ranges and KV blocks per stage; `dtype`: the resolved one (`ComputePlan.dtype`), never "auto"."""
    if config.model.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"model.max_model_len {config.model.max_model_len} exceeds the model's "
            f"max_position_embeddings {arch.max_position_embeddings}"
        )
    ranges = compute_layer_ranges(
        arch.num_layers, config.parallel.pp_size, config.parallel.layer_split, head_cost_in_layers(arch)
    )
    windows = shift_windows(ranges, config.shift_layers) if config.shift_layers else []
    kv_dtype = torch_dtype(dtype)
    capacity = EngineCapacity(0, config.cache.block_size, config.model.max_model_len, ranges, windows)
    num_blocks = config.cache.num_kv_blocks_override or min(
        stage_num_blocks(arch, end - start, config.cache.kv_cache_memory_mb, config.cache.block_size, kv_dtype)
        for start, end in capacity.held_ranges  # shared layers count on both sides: the budget holds
    )
    return dataclasses.replace(capacity, num_blocks=num_blocks)


def kv_connector_context(
    config: EngineConfig, arch: ModelArch, layer_ranges, run_id: str, dtype: str
) -> ConnectorContext | None:
    """The KV connector's plain values (None without one); fails naming the key on a bad connector name.
    `dtype`: the KV cache's, resolved (`ComputePlan.dtype`)."""
    model_id = f"{config.model.source}:{Path(config.model.path).resolve() if config.model.path else 'default'}"
    return connector_context(
        config.kv_transfer,
        layer_ranges=layer_ranges,
        block_size=config.cache.block_size,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype=dtype,
        model_id=model_id,
        run_id=run_id,
    )


def draft_policy(config: SpeculativeConfig) -> DraftPolicy | None:
    """Speculative decoding's policy for the scheduler; None when it is off. An unknown proposer
    name fails here, naming `speculative.method`."""
    if not config.is_enabled:
        return None
    create_proposer(config)
    return DraftPolicy(config.num_speculative_tokens, config.adaptive)


def set_stage_handshakes(
    connector: KVConnectorScheduler, handshakes: dict[tuple[int, int], KVHandshakeMetadata]
) -> None:
    """Hand every stage's handshake to the scheduler connector, before any request. Its refusal
    (a connector unaware of pipeline stages, run with several) fails start-up naming the key."""
    try:
        connector.set_xfer_handshake_metadata_pp_aware(handshakes)
    except ValueError as e:
        raise ConfigError(f"kv_transfer.connector: {e}") from e


def log_shift_layers(config: EngineConfig, log) -> None:
    """Say what `parallel.shift_layers` comes to: a value set that does not apply is a warning; auto
    (-1) says what it chose and why."""
    reason = config.shift_layers_off_reason
    if config.parallel.shift_layers == -1 and config.parallel.pp_size > 1:
        log.info("shift_layers_auto", shift_layers=config.shift_layers, reason=reason or "CPU stages run locally")
    elif reason:
        log.warning("shift_layers_off", shift_layers=config.parallel.shift_layers, reason=reason)
