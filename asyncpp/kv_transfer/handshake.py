"""What a stage tells the engine (and, through it, remote engines) about its KV memory.

After start-up each stage's worker connector returns a `KVHandshakeMetadata`
(`KVConnectorWorker.get_handshake_metadata`): its transfer agent's metadata,
the KV memory it registered, its layer range, block geometry and dtype. The
engine aggregates them by `(pp_rank, tp_rank)` (`aggregate_handshakes`; seed
004, vLLM PR #43720) and hands the dict to its scheduler connector
(`set_xfer_handshake_metadata_pp_aware`). An engine's aggregated handshake,
`EngineHandshake`, is what another engine needs to read from or write to it
(prefill/decode disaggregation): engines exchange it through the client
protocol (`wire.client_msgs.KVHandshakeRequest` / `AddRemoteEngine`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVRegion:
    """One registered KV cache tensor: layer `layer`'s K (`kind` "k") or V ("v") over every block."""

    layer: int  # global layer index
    kind: str  # "k" | "v"
    addr: int  # address of block 0
    nbytes: int  # the whole tensor
    device_id: int = 0
    is_cuda: bool = False


@dataclass(frozen=True)
class KVHandshakeMetadata:
    """One stage's transfer endpoint."""

    pp_rank: int
    tp_rank: int
    start_layer: int  # the layers whose KV this stage serves: [start_layer, end_layer)
    end_layer: int
    block_size: int  # tokens per block
    block_nbytes: int  # bytes of one block of one layer's K (or V)
    dtype: str
    num_blocks: int
    agent_name: str = ""
    agent_metadata: bytes = b""  # the transfer agent's own handshake (NIXL: `get_agent_metadata`)
    regions: list[KVRegion] = field(default_factory=list)

    def region(self, layer: int, kind: str) -> KVRegion:
        for r in self.regions:
            if r.layer == layer and r.kind == kind:
                return r
        raise KeyError(f"stage {self.pp_rank} registered no {kind!r} cache for layer {layer}")


@dataclass(frozen=True)
class EngineHandshake:
    """An engine's stages, aggregated: what a remote engine needs to move KV to or from it."""

    engine_id: str
    pp_size: int
    stages: list[KVHandshakeMetadata] = field(default_factory=list)  # by pp_rank (tp_rank 0)
    # Signs the `kv_transfer_params` this engine hands out, so that an engine pulling from it can
    # tell them from forged ones (`kv_transfer.pd.params`). Only engines see handshakes.
    params_key: bytes = b""
    # How many times the engine's stages were replaced (a restart): their KV memory is new, and
    # whatever the engine handed out before holds nothing any more.
    generation: int = 0

    @staticmethod
    def of(
        engine_id: str, metadata: dict[tuple[int, int], KVHandshakeMetadata], params_key: bytes = b"",
        generation: int = 0,
    ) -> EngineHandshake:
        pp_size = 1 + max(pp_rank for pp_rank, _ in metadata) if metadata else 0
        stages = [metadata[(pp_rank, 0)] for pp_rank in range(pp_size) if (pp_rank, 0) in metadata]
        if len(stages) != pp_size:
            raise ValueError(f"engine {engine_id!r}: handshakes of pp_ranks {sorted(metadata)} leave gaps")
        return EngineHandshake(engine_id, pp_size, stages, params_key, generation)


def aggregate_handshakes(
    items: Iterable[tuple[int, int, KVHandshakeMetadata | None]],
) -> dict[tuple[int, int], KVHandshakeMetadata]:
    """Every stage's `(pp_rank, tp_rank, metadata)` as the engine's dict; stages publishing None
    are left out. Both runtimes build the dict here, so a rank reported twice, or metadata naming
    another rank than the stage that sent it, fails start-up the same way (`ValueError`)."""
    aggregated: dict[tuple[int, int], KVHandshakeMetadata] = {}
    seen: set[tuple[int, int]] = set()
    for pp_rank, tp_rank, metadata in items:
        key = (pp_rank, tp_rank)
        if key in seen:
            raise ValueError(f"two handshakes from (pp_rank, tp_rank) {key}")
        seen.add(key)
        if metadata is None:
            continue
        if (metadata.pp_rank, metadata.tp_rank) != key:
            raise ValueError(
                f"the stage at (pp_rank, tp_rank) {key} published handshake metadata of "
                f"{(metadata.pp_rank, metadata.tp_rank)}"
            )
        aggregated[key] = metadata
    return aggregated
