"""The KV connector API, in two halves, shaped like vLLM's `KVConnectorBase_V1`.

Scheduler side (`KVConnectorScheduler`, one in the engine process):
* `get_num_new_matched_tokens(request, num_computed_tokens)` when a waiting
  request is admitted, after the engine's own prefix cache gave
  `num_computed_tokens`: how many more tokens the connector can supply, and
  whether they load asynchronously (the request then waits in
  `WAITING_FOR_REMOTE_KVS` until every stage has loaded them), or None to be
  asked again on a later step.
* `update_state_after_alloc(request, block_ids, num_external_tokens)` once
  the blocks for those tokens are allocated.
* `build_connector_meta(plan_info)` once per dispatched plan: the
  `KVConnectorMetadata` every stage gets with that plan.
* `update_connector_output(output)` with the output merged over every stage.
* `request_finished(request, block_ids) -> (delay_free_blocks, kv_transfer_params)`:
  with `delay_free_blocks` the engine keeps the blocks until every stage has
  reported the request in `finished_sending`.
* `get_finished_count()`: how many reports finish a request (None: one per stage).
* `set_xfer_handshake_metadata_pp_aware(metadata)` once at start-up, before
  any request: every stage's `KVHandshakeMetadata` keyed by `(pp_rank,
  tp_rank)`. The default refuses `pp_rank > 0` (a connector that does not
  know about pipeline stages fails at start-up, never silently) and hands
  `{tp_rank: metadata}` to `set_xfer_handshake_metadata`.

Worker side (`KVConnectorWorker`, one in every stage, over that stage's layers):
`register_kv_caches`, `bind_connector_metadata` / `clear_connector_metadata`,
`start_load_kv` (before the forward), `save_kv` (after this stage's forward),
`wait_for_save`, `get_finished(finished_req_ids) -> (finished_sending,
finished_recving)`, `get_failed_sending`, `get_block_ids_with_load_errors`,
`handle_preemptions`, `abort_transfers`, `get_stats`, and
`get_handshake_metadata` once after `register_kv_caches` (None: nothing to
publish). The stage calls them
only through `KVConnectorWrapper`, which fixes their order (seed 003:
`post_forward` after sampling and the proposer).

A connector is chosen by name (`kv_transfer.registry`); both halves are built
from a `ConnectorContext` of plain values, never the whole config.

The rule every connector lives by: **every block a transfer holds is
released on every path**: success, load error, save error, a step that
fails on any stage before or after its forward, abort, preemption, timeout,
stage death. The engine and the stage's wrapper enforce it; a worker keeps
its part of the contract:
* Report each load bound to it in `finished_recving` once it no longer
  touches its blocks (failed blocks in `get_block_ids_with_load_errors`),
  and each request named in a plan's `held_req_ids` in `finished_sending`
  once its sends no longer read its blocks (in `failed_sending` too if any
  of them failed). Extra or repeated reports are dropped.
* `handle_preemptions` returns within `save_timeout_s`, aborting what is
  still running by then; `abort_transfers` returns only once nothing of
  those requests touches the KV cache any more. The wrapper then reports
  what they owed as failed. Nothing may raise out of `get_finished`.
* Past `load_timeout_s` / `save_timeout_s` the engine aborts a transfer
  (`KVConnectorMetadata.aborted_req_ids`): a load's blocks are recomputed,
  a send's writes are not trusted, a warning names the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata
from asyncpp.kv_transfer.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferStats,
)

if TYPE_CHECKING:
    from asyncpp.core.request import Request


@dataclass(frozen=True)
class ConnectorContext:
    """Plain values both halves are built from; `extra` holds the connector's own settings."""

    name: str
    pp_size: int
    layer_ranges: tuple[tuple[int, int], ...]  # [start, end) of every stage
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_id: str  # names the weights (source and path): a store written for another model is a miss
    run_id: str  # unique per engine run (names shared-memory segments)
    store: str = "shm"
    store_path: str = ""
    store_size_mb: int = 0
    connector_index: int = 0  # position among a multi-connector's children
    load_timeout_s: float = 30.0  # past it a load is aborted (its blocks recomputed)
    save_timeout_s: float = 30.0  # past it a held request's sends are aborted (their writes dropped)
    kv_role: str = ""  # prefill/decode disaggregation: "producer" | "consumer"
    engine_id: str = ""  # this engine's, among those it moves KV with
    pull_timeout_s: float = 30.0  # a producer's finished prompt's blocks wait this long to be pulled
    extra: dict[str, Any] = field(default_factory=dict)  # the connector's own settings (`kv_transfer.options`)
    children: tuple[ConnectorContext, ...] = ()  # multi-connector: its children's contexts


@dataclass(frozen=True)
class PlanInfo:
    """What `build_connector_meta` sees of a plan: the requests scheduled and the tokens each computes."""

    step_id: int
    # (request, first position, number of tokens) per scheduled request; positions past
    # `request.num_tokens` are placeholders (async scheduling).
    scheduled: list[tuple[Request, int, int]]
    block_ids: dict[str, list[int]]  # request id -> its whole block table
    block_hashes: dict[str, list[bytes]]  # request id -> hashes of its full blocks whose tokens are known
    # request id -> how many of its scheduled positions (the last ones) are drafts (speculative
    # decoding): unverified, their KV is rolled back where rejected, and it is never to be saved.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)


class KVConnectorScheduler(ABC):
    """Engine side. Methods are called from the engine's event loop only."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens beyond `num_computed_tokens` the connector can supply, whether they load asynchronously).

        None for the tokens: ask again later (the connector is already loading that prefix
        for another request, which will then be in the engine's own cache); the request
        keeps its place in the queue.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks for the request are allocated; `num_external_tokens` of them are the connector's to fill."""

    @abstractmethod
    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        """This plan's transfers; what was not sent yet goes with the next plan."""

    def has_unsent_metadata(self) -> bool:
        """Transfers waiting for a plan to carry them (the engine then sends one even if idle)."""
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The merged output of a step: every request in it has been reported by every stage."""

    def validate_kv_transfer_params(self, params: dict[str, Any], prompt_token_ids: list[int]) -> None:
        """A client's `kv_transfer_params` for a new request: raise `ValueError` (or `TypeError`)
        saying what is wrong; the request is then refused and nothing else changes."""
        raise ValueError(f"KV connector {self.ctx.name!r} takes no kv_transfer_params")

    def claim_kv_transfer_params(self, params: dict[str, Any]) -> None:
        """Validated `params` now belong to a queued request (called once it can no longer be refused):
        a connector whose params may be used once remembers them here."""

    def remote_output_token_ids(self, params: dict[str, Any]) -> list[int]:
        """Output tokens a remote engine generated for the request (valid `params`) and already streamed
        to its client: the request starts with them, and its deltas begin after them."""
        return []

    def awaits_remote_prefill(self, params: dict[str, Any]) -> bool:
        """Valid `params` of a request admitted before a remote engine has computed its prompt: it
        starts with no tokens, its KV is loaded meanwhile, and its first tokens come later
        (`accept_remote_prefill`)."""
        return False

    def accept_remote_prefill(self, request: Request, params: dict[str, Any]) -> list[int]:
        """The remote engine's params for a request that `awaits_remote_prefill`, once its prompt is
        computed there: checked like a new request's (`ValueError` / `TypeError` saying what is
        wrong), they give the output tokens it generated and streamed already."""
        raise ValueError(f"KV connector {self.ctx.name!r} awaits no remote prefill")

    def engine_handshake(self) -> EngineHandshake | None:
        """What a remote engine needs to move KV with this one (None: nothing to move)."""
        return None

    def add_remote_engine(self, handshake: EngineHandshake) -> None:
        """A remote engine this one moves KV with; raise `ValueError` if it cannot be used."""
        raise ValueError(f"KV connector {self.ctx.name!r} moves no KV between engines")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until every stage reports `finished_sending`, params for a remote engine)."""
        return False, None

    # A load that fails (or passes load_timeout_s): "recompute" (within a plan, offered with load_async
    # False: the requests that read its blocks start from scratch; an async one computes what did not
    # come), or "fail" them with an error.
    load_failure_policy = "recompute"

    @property
    def send_timeout_s(self) -> float:
        """How long a finished request's blocks may stay held for its sends (`request_finished`)."""
        return self.ctx.save_timeout_s

    def get_finished_count(self) -> int | None:
        """Reports that finish a request; None: one from every pipeline stage."""
        return None

    # The engine restarts lost stages in place (`asyncpp.runtime.recovery`) only if its connector
    # can forget the transfers that died with them (`forget_transfers`).
    can_forget_transfers = False
    # How many times the stages were replaced: published with the engine's handshake and in its
    # health replies, so that a remote engine learns that what it was handed before is gone.
    generation = 0

    def forget_transfers(self) -> None:
        """Every stage was killed (to be started again): the transfers in flight ended with them and
        will never be reported, and every request will be scheduled again from its first token. Forget
        them: what they held is released, what they were writing is not trusted, and what outlives a
        stage (a store's sealed records) stays offered."""
        raise NotImplementedError(f"KV connector {type(self).__name__} cannot go on after a stage restart")

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVHandshakeMetadata]) -> None:
        """Every stage's handshake, keyed by `(pp_rank, tp_rank)`, once at start-up.

        A connector that serves pipeline stages overrides this; the default takes
        one stage only and refuses the rest, so that a connector unaware of pipeline
        parallelism fails at start-up instead of moving one stage's KV for all."""
        beyond = sorted(key for key in metadata if key[0] != 0)
        if beyond:
            raise ValueError(
                f"KV connector {type(self).__name__} is not pipeline-parallel aware: it got handshake "
                f"metadata of (pp_rank, tp_rank) {beyond}; run it with pp_size 1 or use a PP-aware connector"
            )
        self.set_xfer_handshake_metadata({tp_rank: md for (_, tp_rank), md in metadata.items()})

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVHandshakeMetadata]) -> None:
        """The handshake of the one pipeline stage, keyed by tp_rank (connectors without PP)."""

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class KVConnectorWorker(ABC):
    """Stage side. Called from the stage's step loop only (transfers may run on threads of its own)."""

    def __init__(self, ctx: ConnectorContext, pp_rank: int) -> None:
        self.ctx = ctx
        self.pp_rank = pp_rank
        self.start_layer, self.end_layer = ctx.layer_ranges[pp_rank]
        self._metadata: KVConnectorMetadata | None = None

    # ---- metadata -------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def metadata(self) -> KVConnectorMetadata:
        if self._metadata is None:
            raise RuntimeError("no connector metadata bound: only valid between pre_forward and post_forward")
        return self._metadata

    @property
    def has_metadata(self) -> bool:
        return self._metadata is not None

    # ---- transfers ------------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This stage's paged cache: global layer index -> (K, V), each `[num_blocks * block_size, heads, dim]`."""

    def start_load_kv(self, step_id: int) -> None:
        """Start the bound loads (before the forward reads any of those blocks)."""

    def save_kv(self, step_id: int) -> None:
        """Start the bound saves: this stage's forward has written every block they name."""

    def wait_for_save(self) -> None:
        """Block until saves that must finish within the step are done (async connectors return at once)."""

    def handle_preemptions(self, preempted_req_ids: list[str]) -> None:
        """Their blocks may be reused by this plan: finish whatever still reads them first (within
        `save_timeout_s`; abort what is still running then)."""

    def abort_transfers(self, request_ids: list[str]) -> None:
        """Stop these requests' transfers (past their deadline, or their step failed): once this
        returns, none of them reads or writes the KV cache. Whatever they wrote elsewhere is not
        trusted. The wrapper reports what they owed; later reports of them are dropped."""

    @abstractmethod
    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        """(requests done sending, requests done receiving) on this stage since the last call."""

    def get_failed_sending(self) -> frozenset[str]:
        """Of the requests the latest `get_finished` reported finished sending, those whose sends
        failed (whatever they wrote is not trusted)."""
        return frozenset()

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks whose load failed since the last call (their tokens must be recomputed)."""
        return frozenset()

    def get_quarantined_blocks(self) -> tuple[list[int], list[int]]:
        """(blocks quarantined, blocks released) since the last call: a read into a block that the
        transport could not stop keeps it out of the free pool until the transport confirms it ended."""
        return [], []

    def get_stats(self) -> KVTransferStats:
        """Counters since the last call."""
        return KVTransferStats()

    def get_handshake_metadata(self) -> KVHandshakeMetadata | None:
        """This stage's transfer endpoint (after `register_kv_caches`), or None: nothing to publish."""
        return None

    def close(self) -> None:
        pass


def collect_output(worker: KVConnectorWorker, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
    sending, recving = worker.get_finished(finished_req_ids)
    quarantined, released = worker.get_quarantined_blocks()
    return KVConnectorOutput(
        sending, recving, worker.get_block_ids_with_load_errors(), worker.get_stats(), worker.get_failed_sending(),
        quarantined, released,
    )  # fmt: skip
