"""What the two halves of a KV connector tell each other: per-step metadata and per-stage outputs.

`KVConnectorMetadata` is built by the scheduler side once per plan and
travels inside the `StepPlan` to every stage (msgpack, like the rest of the
plan): which blocks each stage loads into its cache and which it saves from
it. It is flat on purpose: a multi-connector tags each transfer with the
index of the child that owns it (`connector_index`) instead of nesting
metadata, so one typed message serves every connector.

`KVConnectorOutput` is what one stage reports after one step: the requests
whose transfers finished on that stage (a request is finished only when every
stage has reported it; see `kv_transfer.aggregator`), the blocks that failed
to load, blocks a read it could not stop may still write (quarantined until
it reports them released), and transfer counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncpp.kv_transfer.handshake import EngineHandshake


@dataclass(frozen=True)
class BlockTransfer:
    """One request's blocks to move this step, the same block ids on every stage."""

    request_id: str
    block_ids: list[int]  # engine block ids (the paged cache's)
    block_hashes: list[bytes]  # prefix-chain hash of each block (`kv.block_hash`), the store's key
    slots: list[int] = field(default_factory=list)  # where each block lives in the connector's store, if it has slots
    connector_index: int = 0  # the child of a multi-connector that owns it (0 otherwise)
    # Prefill/decode disaggregation: the same blocks' ids on a remote engine, and its request.
    remote_engine_id: str = ""
    remote_request_id: str = ""
    remote_block_ids: list[int] = field(default_factory=list)
    # A load within this plan (offered synchronously): done on every stage before its forward.
    is_sync: bool = False
    # When the KV was ready at its source (time.time() there; the producer's first token): the
    # stage reports how long it took from then until it had the blocks (`handover_s`).
    remote_ready_at: float = 0.0
    # A pull awaited before its KV exists (early handover): read once the producer's stages say the
    # prompt's `num_tokens` tokens are computed, their block ids from `remote_first_block` on.
    on_ready: bool = False
    num_tokens: int = 0
    remote_first_block: int = 0
    # Producer side of it (a save): the prompt's tokens computed once this step's forward is done.
    num_ready_tokens: int = 0
    # The nonce of the signed params handed out for the remote request: a pull's notifications name
    # it, so that the producer counts the readers of that one handout (a save: the params to come).
    nonce: str = ""


@dataclass(frozen=True)
class KVConnectorMetadata:
    loads: list[BlockTransfer] = field(default_factory=list)  # external KV -> these blocks, before they are used
    saves: list[BlockTransfer] = field(default_factory=list)  # these blocks -> external, after this step wrote them
    # Multi-connector: request (finished since the last plan) -> the children keeping its blocks
    # for a send; a stage reports it finished sending once each of those children has.
    send_holders: dict[str, list[int]] = field(default_factory=dict)
    # Set by the engine, not the connector. Requests finished since the last plan whose blocks
    # the engine keeps until every stage reports them in `finished_sending` (exactly once each).
    held_req_ids: list[str] = field(default_factory=list)
    # Requests whose transfers passed their deadline (`load_timeout_s`, `save_timeout_s`): each
    # stage stops them (`abort_transfers`) and reports them as failed.
    aborted_req_ids: list[str] = field(default_factory=list)
    # Remote engines every stage must be able to reach from this plan on (their handshakes).
    remote_engines: list[EngineHandshake] = field(default_factory=list)
    # Requests this plan computes for the first time after a remote prefill whose KV was loaded
    # before: when their first token was sampled there (for the stages' `handover_s`).
    handover_at: dict[str, float] = field(default_factory=dict)
    # Prefill/decode producer: request -> the nonce of the params handed out for it (its blocks are
    # released once the readers of that handout, and no other, are done).
    send_nonces: dict[str, str] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.loads or self.saves or self.send_holders or self.held_req_ids or self.aborted_req_ids
            or self.remote_engines or self.handover_at or self.send_nonces
        )  # fmt: skip


@dataclass(frozen=True)
class KVTransferStats:
    """Counters of one stage over one step (summed by the engine over stages and steps)."""

    num_blocks_loaded: int = 0
    num_blocks_saved: int = 0
    num_bytes_loaded: int = 0
    num_bytes_saved: int = 0
    load_time_s: float = 0.0  # time the transfer thread spent loading
    save_time_s: float = 0.0
    # Request -> seconds from `BlockTransfer.remote_ready_at` until this stage had its blocks (for a
    # load within a plan: the start of the forward that uses them). Stages merge by the latest.
    handover_s: dict[str, float] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.num_blocks_loaded or self.num_blocks_saved or self.load_time_s or self.save_time_s or self.handover_s
        )

    def __add__(self, other: "KVTransferStats") -> "KVTransferStats":
        return KVTransferStats(
            self.num_blocks_loaded + other.num_blocks_loaded,
            self.num_blocks_saved + other.num_blocks_saved,
            self.num_bytes_loaded + other.num_bytes_loaded,
            self.num_bytes_saved + other.num_bytes_saved,
            self.load_time_s + other.load_time_s,
            self.save_time_s + other.save_time_s,
            _latest(self.handover_s, other.handover_s),
        )


def _latest(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    if not b:
        return a
    if not a:
        return b
    return {key: max(a.get(key, 0.0), b.get(key, 0.0)) for key in a.keys() | b.keys()}


@dataclass(frozen=True)
class KVConnectorOutput:
    """Requests whose async KV transfers finished on this stage since its last report."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()  # blocks whose load failed: recompute them
    stats: KVTransferStats = field(default_factory=KVTransferStats)
    # Of `finished_sending`: requests whose sends (saves) failed, were skipped or timed out on
    # this stage. Nothing they wrote may be trusted (the offload index drops their slots).
    failed_sending: frozenset[str] = frozenset()
    # Blocks a read into this stage's cache may still write (the transport could not stop it): they
    # must not be reused until the same stage names them in `released_block_ids`. Counted: a block
    # named twice is released twice.
    quarantined_block_ids: list[int] = field(default_factory=list)
    released_block_ids: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return (
            not self.finished_sending
            and not self.finished_recving
            and not self.invalid_block_ids
            and self.stats.is_empty
            and not self.quarantined_block_ids
            and not self.released_block_ids
        )
