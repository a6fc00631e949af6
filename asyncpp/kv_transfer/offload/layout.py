"""Where and how big each stage's offload store is: computed alike in the engine and in every stage.

Every stage gets the same number of slots (the engine's index hands out one
slot per block hash, the same on every stage), as many as the smallest
stage's byte budget (`kv_transfer.store_size_mb`, per stage) holds.
"""

from __future__ import annotations

from pathlib import Path

from asyncpp.config import ConfigError
from asyncpp.kv_transfer.base import ConnectorContext
from asyncpp.kv_transfer.offload.store import StoreLayout, slots_for_budget, store_fingerprint

_HEADER_NBYTES = 128  # of a store record; StoreLayout.record_nbytes includes it


def stage_layouts(ctx: ConnectorContext) -> list[StoreLayout]:
    """One layout per stage, all with the same number of slots."""
    budget = ctx.store_size_mb * 1024 * 1024

    def layout(start: int, end: int, num_slots: int) -> StoreLayout:
        return StoreLayout(
            num_slots=num_slots,
            num_layers=end - start,
            block_size=ctx.block_size,
            num_kv_heads=ctx.num_kv_heads,
            head_dim=ctx.head_dim,
            dtype=ctx.dtype,
            fingerprint=store_fingerprint(
                ctx.model_id, start, end, ctx.dtype, ctx.block_size, ctx.num_kv_heads, ctx.head_dim
            ),
        )

    record_nbytes = [layout(start, end, 1).record_nbytes for start, end in ctx.layer_ranges]
    num_slots = min(slots_for_budget(budget, n) for n in record_nbytes)
    if num_slots < 1:
        raise ConfigError(
            f"kv_transfer.store_size_mb = {ctx.store_size_mb} holds no KV block "
            f"(a block of the largest stage takes {max(record_nbytes)} bytes)"
        )
    return [layout(start, end, num_slots) for start, end in ctx.layer_ranges]


def shm_name(ctx: ConnectorContext, pp_rank: int) -> str:
    """POSIX shm names are short: the run id keeps engines apart, the index a multi-connector's children."""
    return f"asyncpp-{ctx.run_id}-kv{ctx.connector_index}-{pp_rank}"


def stage_dir(ctx: ConnectorContext, pp_rank: int) -> Path:
    """A directory per layer range: a restart with another split finds nothing (a miss, not an error)."""
    start, end = ctx.layer_ranges[pp_rank]
    return Path(ctx.store_path) / f"layers-{start:03d}-{end:03d}"
