"""`TransferTopology`: which remote stage holds which layers, per remote engine.

An engine that moves KV with others (prefill/decode disaggregation) registers
each remote engine's `EngineHandshake` here. Every remote stage becomes one
`EngineTransferInfo`, stored under `(engine_id, pp_rank)` (seed 004, vLLM PR
#43720), so the two engines may use different PP sizes and splits: a local
stage owning layers `[s, e)` reads each of them from whichever remote stage
owns it (`sources_for`), and a producing stage learns how many consumer
stages will read from it (`readers_of`), the count its blocks wait for.

Registration checks what would otherwise corrupt KV silently: the remote
stages cover every layer of the model exactly once, and their block size,
dtype (and, when known, bytes per block) are the local engine's. A refused
handshake changes nothing; registering an engine id again replaces it.
Pure Python, no transport: the transports (`kv_transfer.pd`) use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata, KVRegion


@dataclass(frozen=True)
class EngineTransferInfo:
    """One remote stage, as a local engine reads from (or writes to) it."""

    remote_pp_size: int
    remote_pp_rank: int
    start_layer: int  # the layers whose KV it serves: [start_layer, end_layer)
    end_layer: int
    remote_block_size: int  # tokens per block
    remote_block_len: int  # bytes of one block of one layer's K (or V)
    dtype: str
    agent_name: str
    agent_metadata: bytes  # the transfer agent's own handshake
    regions: tuple[KVRegion, ...] = ()
    remote_num_blocks: int = 0  # blocks in its cache: a block id handed out must be below it

    @staticmethod
    def of(metadata: KVHandshakeMetadata, pp_size: int) -> EngineTransferInfo:
        return EngineTransferInfo(
            remote_pp_size=pp_size,
            remote_pp_rank=metadata.pp_rank,
            start_layer=metadata.start_layer,
            end_layer=metadata.end_layer,
            remote_block_size=metadata.block_size,
            remote_block_len=metadata.block_nbytes,
            dtype=metadata.dtype,
            agent_name=metadata.agent_name,
            agent_metadata=metadata.agent_metadata,
            regions=tuple(metadata.regions),
            remote_num_blocks=metadata.num_blocks,
        )

    def region(self, layer: int, kind: str) -> KVRegion:
        for r in self.regions:
            if r.layer == layer and r.kind == kind:
                return r
        raise KeyError(f"remote stage {self.remote_pp_rank} registered no {kind!r} cache for layer {layer}")


class TransferTopology:
    """Remote engines' stages by `(engine_id, pp_rank)`, checked against the local engine's geometry."""

    def __init__(self, local_engine_id: str, block_size: int, dtype: str, num_layers: int, block_len: int = 0) -> None:
        self.local_engine_id = local_engine_id
        self.block_size = block_size  # tokens per block
        self.dtype = dtype
        self.num_layers = num_layers
        self.block_len = block_len  # bytes of one block of one layer's K (or V); 0: not checked
        self._engines: dict[tuple[str, int], EngineTransferInfo] = {}
        self._pp_sizes: dict[str, int] = {}

    # ---- registration ---------------------------------------------------------------------
    def register_remote_engine(self, handshake: EngineHandshake) -> list[EngineTransferInfo]:
        """Check the handshake, then store (or replace) every stage of it; its infos by pp_rank."""
        engine_id = handshake.engine_id
        if engine_id == self.local_engine_id:
            raise ValueError(f"engine {engine_id!r} is this engine: it cannot be its own remote engine")
        infos = [EngineTransferInfo.of(md, handshake.pp_size) for md in self._checked_stages(handshake)]
        self.remove_remote_engine(engine_id)
        for info in infos:
            self._engines[(engine_id, info.remote_pp_rank)] = info
        self._pp_sizes[engine_id] = handshake.pp_size
        return infos

    def remove_remote_engine(self, engine_id: str) -> None:
        for pp_rank in range(self._pp_sizes.pop(engine_id, 0)):
            del self._engines[(engine_id, pp_rank)]

    def _checked_stages(self, handshake: EngineHandshake) -> list[KVHandshakeMetadata]:
        where = f"remote engine {handshake.engine_id!r}"
        stages = handshake.stages
        if handshake.pp_size < 1 or len(stages) != handshake.pp_size:
            raise ValueError(f"{where}: pp_size {handshake.pp_size} but {len(stages)} stage handshakes")
        for pp_rank, md in enumerate(stages):
            at = f"{where}: stage {pp_rank}"
            if (md.pp_rank, md.tp_rank) != (pp_rank, 0):
                raise ValueError(f"{at}'s handshake is (pp_rank, tp_rank) {(md.pp_rank, md.tp_rank)}")
            if md.block_size != self.block_size:
                raise ValueError(f"{at} has block_size {md.block_size}, this engine {self.block_size}")
            if md.dtype != self.dtype:
                raise ValueError(f"{at} has KV dtype {md.dtype}, this engine {self.dtype}")
            if self.block_len and md.block_nbytes != self.block_len:
                raise ValueError(
                    f"{at} has {md.block_nbytes} bytes per block and layer, "
                    f"this engine {self.block_len} (another model's KV?)"
                )
            if md.block_nbytes != stages[0].block_nbytes:
                raise ValueError(
                    f"{where}: its stages disagree on bytes per block ({stages[0].block_nbytes}, {md.block_nbytes})"
                )
            if not md.start_layer < md.end_layer:
                raise ValueError(f"{at} serves no layers ([{md.start_layer}, {md.end_layer}))")
        self._check_coverage(where, [(md.start_layer, md.end_layer) for md in stages])
        return stages

    def _check_coverage(self, where: str, ranges: list[tuple[int, int]]) -> None:
        """Every layer of the model served by exactly one remote stage."""
        covered = 0  # layers [0, covered) are served, once each
        for start, end in sorted(ranges):
            if start > covered:
                raise ValueError(f"{where}: no stage serves layers [{covered}, {start})")
            if start < covered:
                raise ValueError(f"{where}: layers [{start}, {min(covered, end)}) are served by two stages")
            covered = end
        if covered != self.num_layers:
            what = f"no stage serves layers [{covered}, {self.num_layers})" if covered < self.num_layers else (
                f"its stages serve {covered} layers, the model has {self.num_layers}"
            )
            raise ValueError(f"{where}: {what}")

    # ---- lookups --------------------------------------------------------------------------
    def has_engine(self, engine_id: str) -> bool:
        return engine_id in self._pp_sizes

    def remote_pp_size(self, engine_id: str) -> int:
        if engine_id not in self._pp_sizes:
            raise KeyError(f"unknown remote engine {engine_id!r}")
        return self._pp_sizes[engine_id]

    def get_engine_info(self, engine_id: str, pp_rank: int) -> EngineTransferInfo:
        info = self._engines.get((engine_id, pp_rank))
        if info is None:
            raise KeyError(f"no stage {pp_rank} of remote engine {engine_id!r}")
        return info

    def remote_layer_ranges(self, engine_id: str) -> list[tuple[int, int]]:
        """The remote engine's stages' `[start, end)`, by pp_rank."""
        return [(i.start_layer, i.end_layer) for i in self._infos(engine_id)]

    def sources_for(self, engine_id: str, start_layer: int, end_layer: int) -> list[tuple[int, tuple[int, int]]]:
        """For a local stage owning `[start_layer, end_layer)`: (remote pp_rank, the layers read from
        it) for every remote stage holding some of them, by pp_rank."""
        sources = []
        for info in self._infos(engine_id):
            start, end = max(start_layer, info.start_layer), min(end_layer, info.end_layer)
            if start < end:
                sources.append((info.remote_pp_rank, (start, end)))
        return sources

    @staticmethod
    def readers_of(reader_ranges: list[tuple[int, int]], remote_start: int, remote_end: int) -> int:
        """How many of the reading engine's stages (`reader_ranges`, one `[start, end)` each) read
        from a stage owning `[remote_start, remote_end)`: the reports a producer's blocks wait for."""
        return sum(1 for start, end in reader_ranges if max(start, remote_start) < min(end, remote_end))

    def describe(self) -> dict[str, Any]:
        return {
            "local_engine_id": self.local_engine_id,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "remote_engines": {
                engine_id: [
                    {"pp_rank": i.remote_pp_rank, "layers": [i.start_layer, i.end_layer], "agent_name": i.agent_name}
                    for i in self._infos(engine_id)
                ]
                for engine_id in sorted(self._pp_sizes)
            },
        }

    def _infos(self, engine_id: str) -> list[EngineTransferInfo]:
        return [self._engines[(engine_id, pp_rank)] for pp_rank in range(self.remote_pp_size(engine_id))]
