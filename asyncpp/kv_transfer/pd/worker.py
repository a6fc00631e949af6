"""`PDWorker`: a stage's side of prefill/decode disaggregation, over one NIXL agent.

At start-up the stage registers the K and V caches of its layers with its
agent once and publishes them (`get_handshake_metadata`). Remote engines'
handshakes arrive with plans (`KVConnectorMetadata.remote_engines`); the
stage adds their agents.

Consumer: for each pull bound to the plan, the stage reads, from every
producer stage holding some of its layers (`TransferTopology.sources_for`),
those layers' blocks in ONE NIXL read per (request, producer stage): a
descriptor list of block runs, K and V of every layer, consecutive blocks
merged. Each read carries a notification (`readers.notification`, naming
the nonce of the params it reads under) that the producer stage gets once
the read is over. A pull is reported in `finished_recving` once all its
reads ended; a failed read makes all of the
request's blocks invalid. The stage never waits for a read: `start_load_kv`
posts them and `get_finished` polls them after each step, so a hung producer
(a read whose completion never comes) delays no other request; the engine
aborts its pull at `load_timeout_s`, and a read NIXL cannot stop then is
abandoned at once (`_RELEASE_WAIT_S`), its blocks quarantined until it ends. A pull that
ended well reports its handover (`KVTransferStats.handover_s`): from the
producer's first token (`BlockTransfer.remote_ready_at`) to the blocks being
here. A release (nothing to pull) sends the notifications alone.

Early handover: a pull bound `on_ready` reads as the producer stages send
ready notices (`params.ReadyNotice`), each from `save_kv` right after a
forward that computed a chunk of the prompt in its layers (on CUDA once that
forward is done): every notice starts a read of the blocks it completed, and
the one for the whole prompt carries the notification. A void notice (the
producer preempted the request) makes every chunk be read again, once the
reads from that producer stage so far have ended (they would race the new
ones on the same local blocks; one still running after `_RELEASE_WAIT_S`
fails the pull). Notices may arrive before the pull is bound: they wait up
to `pull_timeout_s`, then the producer is told nobody reads (as for a pull
that ended before its notice came).

A read NIXL cannot stop (`release` raises `TimeoutError`: it may still write)
fails its pull, and its local blocks are quarantined
(`get_quarantined_blocks`): the engine keeps them out of its free pool, and
every step looks again, without waiting, until the read has ended; then they
are reported released.

Producer: a held request (`held_req_ids`) is reported in `finished_sending`
once every consumer stage that reads this stage's layers has notified it
under the nonce of its handout (`send_nonces`; see `readers`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorWorker
from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata, KVRegion
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVTransferStats
from asyncpp.transport.nixl_agent import NixlTransport, TransferState, block_runs
from asyncpp.kv_transfer.pd.params import ReadyNotice
from asyncpp.kv_transfer.pd.quarantine import Quarantine
from asyncpp.kv_transfer.pd.readers import HandoutReaders, notification, parse_notification
from asyncpp.kv_transfer.pd.topology import TransferTopology
from asyncpp.logging import get_logger


# How long the stage waits, when a pull is aborted or fails, for a read still running to end before
# it abandons it (logged `kv_pull_not_stopped`, its blocks invalid): never the step loop's time. A
# SIGSTOPped producer leaves reads running (their notification is never acknowledged) until SIGCONT.
_RELEASE_WAIT_S = 0.005


@dataclass
class _Pull:
    transfer: BlockTransfer
    handles: list = field(default_factory=list)
    notifs: list[tuple[str, bytes]] = field(default_factory=list)  # (agent, message) per producer stage read
    nbytes: int = 0
    awaited_ranks: set[int] = field(default_factory=set)  # on_ready: producer stages not done yet
    next_block: dict[int, int] = field(default_factory=dict)  # on_ready: producer stage -> its next prompt block to read
    rank_handles: dict[int, list] = field(default_factory=dict)  # producer stage -> its reads (of `handles`)
    started_at: float = field(default_factory=time.perf_counter)


class PDWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, pp_rank: int) -> None:
        super().__init__(ctx, pp_rank)
        self.role = ctx.kv_role
        num_layers = ctx.layer_ranges[-1][1]
        self.topology = TransferTopology(ctx.engine_id, ctx.block_size, ctx.dtype, num_layers)
        self.transport: NixlTransport | None = None
        self._bases: dict[tuple[int, str], int] = {}  # (layer, "k" | "v") -> address of block 0
        self._regions: list[KVRegion] = []
        self._block_nbytes = 0
        self._num_blocks = 0
        self._agents: dict[tuple[str, int], str] = {}  # (engine id, pp_rank) -> agent name
        self._pulls: dict[str, _Pull] = {}
        self._finished_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._quarantine = Quarantine(pp_rank)  # reads NIXL could not stop, and their blocks
        self._handouts = HandoutReaders(ctx.pull_timeout_s, pp_rank)  # producer: held requests' readers
        # Consumer, early handover: remote request -> the local request whose pull awaits notices;
        # notices no pull awaits yet (remote request -> them, and when the first came); remote
        # requests whose pull ended (or was a release) before every notice came (until pull_timeout_s).
        self._awaiting: dict[str, str] = {}
        self._early_notices: dict[str, list[ReadyNotice]] = {}
        self._early_since: dict[str, float] = {}
        self._dropped: dict[str, float] = {}
        # Producer: request -> (the consumer engine told of some of its chunks, the handout's nonce).
        self._noticed: dict[str, tuple[str, str]] = {}
        self._stats = KVTransferStats()
        self.log = get_logger(role="stage", pp_rank=pp_rank, connector="pd", kv_role=self.role)

    # ---- start-up --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = sorted(kv_caches)
        if layers != list(range(self.start_layer, self.end_layer)):
            raise ValueError(f"stage {self.pp_rank} owns layers {self.start_layer}..{self.end_layer}, got {layers}")
        tensors = [t for layer in layers for t in kv_caches[layer]]
        if any(not t.is_contiguous() for t in tensors):
            raise ValueError("the pd connector needs contiguous KV caches")
        self.transport = NixlTransport(f"{self.ctx.engine_id}-pp{self.pp_rank}", release_timeout_s=_RELEASE_WAIT_S)
        self.transport.register(tensors)
        first = tensors[0]
        self._block_nbytes = first[: self.ctx.block_size].nbytes
        self._num_blocks = first.shape[0] // self.ctx.block_size
        for layer in layers:
            for kind, tensor in zip(("k", "v"), kv_caches[layer]):
                self._bases[(layer, kind)] = tensor.data_ptr()
                self._regions.append(
                    KVRegion(
                        layer, kind, tensor.data_ptr(), tensor.nbytes,
                        tensor.device.index or 0, tensor.device.type == "cuda",
                    )  # fmt: skip
                )

    def get_handshake_metadata(self) -> KVHandshakeMetadata | None:
        if self.transport is None:
            return None
        return KVHandshakeMetadata(
            pp_rank=self.pp_rank,
            tp_rank=0,
            start_layer=self.start_layer,
            end_layer=self.end_layer,
            block_size=self.ctx.block_size,
            block_nbytes=self._block_nbytes,
            dtype=self.ctx.dtype,
            num_blocks=self._num_blocks,
            agent_name=self.transport.name,
            agent_metadata=self.transport.agent_metadata(),
            regions=list(self._regions),
        )

    def _add_remote(self, handshake: EngineHandshake) -> None:
        self.topology.register_remote_engine(handshake)
        for stage in handshake.stages:
            key = (handshake.engine_id, stage.pp_rank)
            if key in self._agents:  # the engine again (restarted): its agents may be new ones
                self.transport.remove_remote(self._agents.pop(key))
            try:
                self._agents[key] = self.transport.add_remote(stage.agent_metadata)
            except Exception as e:  # noqa: BLE001 - unreachable now: pulls from it fail alone
                self.log.warning("remote_agent_unreachable", engine_id=handshake.engine_id, remote_pp_rank=stage.pp_rank, error=repr(e))
        self.log.info("remote_engine_added", engine_id=handshake.engine_id, pp_size=handshake.pp_size)

    # ---- per step --------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        for handshake in metadata.remote_engines:
            self._add_remote(handshake)
        if self.role == "producer":
            self._handouts.hold(metadata.held_req_ids, metadata.send_nonces)
        if self.transport is not None:
            self.transport.release_ended()  # abandoned reads that ended meanwhile (a producer resumed)

    def start_load_kv(self, step_id: int) -> None:
        if self.metadata.handover_at:  # these requests' first forward after an early handover starts now
            now = time.time()
            handover_s = {request_id: now - at for request_id, at in self.metadata.handover_at.items()}
            self._stats = self._stats + KVTransferStats(handover_s=handover_s)
        for transfer in self.metadata.loads:  # posted, never waited for: `get_finished` polls them
            if transfer.on_ready:
                self._await_pull(transfer)
                continue
            self._start_pull(transfer)

    def _start_pull(self, transfer: BlockTransfer) -> None:
        pull = _Pull(transfer)
        self._pulls[transfer.request_id] = pull
        if not transfer.block_ids:  # a release: notices still to come for it are answered, not kept
            self._dropped[transfer.remote_request_id] = time.monotonic()
        try:
            for remote_rank, layers in self.topology.sources_for(transfer.remote_engine_id, self.start_layer, self.end_layer):
                notif = self._done_notif(pull, remote_rank)
                self._read(pull, remote_rank, layers, transfer.block_ids, transfer.remote_block_ids, notif)
        except Exception as e:  # noqa: BLE001 - a pull that cannot start fails alone (recomputed)
            self.log.warning("kv_pull_failed", request_id=transfer.request_id, error=repr(e))
            self._end_pull(transfer.request_id, failed=True)

    def _done_notif(self, pull: _Pull, remote_rank: int) -> bytes:
        """What tells that producer stage this stage is done with the request (sent again if the pull
        fails, so that it never waits for its timeout)."""
        engine_id = pull.transfer.remote_engine_id
        notif = self._done_message(engine_id, remote_rank, pull.transfer.remote_request_id, pull.transfer.nonce)
        pull.notifs.append((self._agents[(engine_id, remote_rank)], notif))
        return notif

    def _done_message(self, engine_id: str, remote_rank: int, remote_request_id: str, nonce: str) -> bytes:
        info = self.topology.get_engine_info(engine_id, remote_rank)
        return notification(remote_request_id, nonce, self.pp_rank, self._readers_of(info))

    def _read(
        self, pull: _Pull, remote_rank: int, layers: tuple[int, int], block_ids: list[int], remote_block_ids: list[int],
        notif: bytes,
    ) -> None:  # fmt: skip
        """One NIXL read of this stage's `layers` of these blocks held by one producer stage; `notif`
        reaches it once the read is over (sent alone when there is nothing to read)."""
        engine_id = pull.transfer.remote_engine_id
        info = self.topology.get_engine_info(engine_id, remote_rank)
        agent = self._agents[(engine_id, remote_rank)]
        runs = []
        for layer in range(*layers):
            for kind in ("k", "v"):
                runs += block_runs(
                    block_ids, remote_block_ids,
                    self._bases[(layer, kind)], info.region(layer, kind).addr, self._block_nbytes,
                )  # fmt: skip
        if runs:
            device = info.regions[0]
            handle = self.transport.read(agent, runs, notif, device.is_cuda, device.device_id)
            pull.handles.append(handle)
            pull.rank_handles.setdefault(remote_rank, []).append(handle)
            pull.nbytes += sum(n for _, _, n in runs)
        elif notif:
            self.transport.send_notif(agent, notif)  # a release: nothing to read

    def _readers_of(self, info) -> int:
        return TransferTopology.readers_of(list(self.ctx.layer_ranges), info.start_layer, info.end_layer)

    # ---- early handover (consumer) ---------------------------------------------------------
    def _await_pull(self, transfer: BlockTransfer) -> None:
        """A pull whose reads start as the producer stages' ready notices come."""
        pull = _Pull(transfer)
        self._pulls[transfer.request_id] = pull
        try:
            sources = self.topology.sources_for(transfer.remote_engine_id, self.start_layer, self.end_layer)
            for rank, _ in sources:
                self._done_notif(pull, rank)
        except Exception as e:  # noqa: BLE001 - the engine is gone meanwhile: fails alone
            self.log.warning("kv_pull_failed", request_id=transfer.request_id, error=repr(e))
            self._end_pull(transfer.request_id, failed=True)
            return
        pull.awaited_ranks = {rank for rank, _ in sources}
        pull.next_block = {rank: transfer.remote_first_block for rank, _ in sources}
        self._awaiting[transfer.remote_request_id] = transfer.request_id
        self._early_since.pop(transfer.remote_request_id, None)
        for notice in self._early_notices.pop(transfer.remote_request_id, []):
            self._on_ready(notice)

    def _on_ready(self, notice: ReadyNotice) -> None:
        """A producer stage's ready notice: read the blocks it completed for the pull that awaits them."""
        request_id = self._awaiting.get(notice.request_id)
        pull = self._pulls.get(request_id) if request_id is not None else None
        if pull is None or pull.transfer.remote_engine_id != notice.engine_id:
            if notice.request_id in self._dropped:  # ended before the notice came: free its blocks there
                if notice.is_complete:
                    self._release_remote(notice)
            else:
                self._early_notices.setdefault(notice.request_id, []).append(notice)
                self._early_since.setdefault(notice.request_id, time.monotonic())
            return
        transfer, rank = pull.transfer, notice.pp_rank
        if rank not in pull.awaited_ranks:
            return  # a duplicate, or a stage whose layers this one does not read
        first = transfer.remote_first_block
        if notice.is_void:  # the producer computes the prompt again: so are its chunks read again
            pull.next_block[rank] = first
            self._stop_reads(request_id, pull, rank)
            return
        try:
            num_blocks = -(-notice.num_tokens // self.ctx.block_size)
            if notice.num_tokens != transfer.num_tokens or len(notice.block_ids) > num_blocks:
                raise ValueError(f"the producer's prompt has {notice.num_tokens} tokens in {num_blocks} blocks, "
                                 f"this request's {transfer.num_tokens}")  # fmt: skip
            # Blocks complete (every block once the whole prompt is): read those not read yet.
            end = len(notice.block_ids) if notice.is_complete else notice.num_ready_tokens // self.ctx.block_size
            start = pull.next_block[rank]
            if end > start or notice.is_complete:
                sources = dict(self.topology.sources_for(transfer.remote_engine_id, self.start_layer, self.end_layer))
                notif = self._done_message(notice.engine_id, rank, notice.request_id, notice.nonce)
                agent = self._agents[(notice.engine_id, rank)]  # a failed pull tells this handout's readers
                pull.notifs = [(a, n) if a != agent else (a, notif) for a, n in pull.notifs]
                self._read(
                    pull, rank, sources[rank], transfer.block_ids[start - first : end - first],
                    notice.block_ids[start:end], notif if notice.is_complete else b"",
                )  # fmt: skip
                pull.next_block[rank] = max(start, end)
            if notice.is_complete:
                pull.awaited_ranks.discard(rank)
        except Exception as e:  # noqa: BLE001 - this pull fails alone (its request fails)
            self.log.warning("kv_pull_failed", request_id=request_id, error=repr(e))
            self._end_pull(request_id, failed=True)

    def _stop_reads(self, request_id: str, pull: _Pull, rank: int) -> None:
        """A void notice: the reads from that producer stage so far are superseded (its blocks are
        freed there, the chunks come again into the same local blocks). Wait for them to end before
        any new read targets those blocks; one NIXL cannot stop fails the pull (its blocks are
        quarantined)."""
        for handle in pull.rank_handles.pop(rank, []):
            pull.handles.remove(handle)
            if not self._quarantine.release(self.transport, handle, pull.transfer.block_ids, request_id):
                self._end_pull(request_id, failed=True)
                return

    def _release_remote(self, notice: ReadyNotice) -> None:
        """Tell the producer stage that this stage will not read its blocks for that request."""
        agent = self._agents.get((notice.engine_id, notice.pp_rank))
        if agent is not None:
            self._notify(agent, self._done_message(notice.engine_id, notice.pp_rank, notice.request_id, notice.nonce))

    def _expire_early_notices(self, now: float) -> None:
        for remote_request_id, since in list(self._early_since.items()):
            if now - since > self.ctx.pull_timeout_s:  # nobody here awaits it: let the producer go
                del self._early_since[remote_request_id]
                for notice in self._early_notices.pop(remote_request_id, []):
                    self._release_remote(notice)
        for remote_request_id, at in list(self._dropped.items()):
            if now - at > self.ctx.pull_timeout_s:
                del self._dropped[remote_request_id]

    # ---- early handover (producer) ---------------------------------------------------------
    def save_kv(self, step_id: int) -> None:
        """Producer: this step's forward computed chunks of these prompts in this stage's layers: tell
        the consumer stages that read them where they are."""
        if self.role != "producer" or not self.metadata.saves:
            return
        if any(region.is_cuda for region in self._regions):
            torch.cuda.current_stream().synchronize()  # the forward's writes are done before anyone reads
        for save in self.metadata.saves:
            notice = ReadyNotice(
                self.ctx.engine_id, save.request_id, save.nonce, self.pp_rank, save.num_tokens, save.num_ready_tokens,
                save.block_ids,
            )  # fmt: skip
            self._send_notice(save.remote_engine_id, notice)
            if notice.is_complete:
                self._noticed.pop(save.request_id, None)
            else:
                self._noticed[save.request_id] = (save.remote_engine_id, save.nonce)

    def handle_preemptions(self, preempted_req_ids: list[str]) -> None:
        """Producer: chunks told to consumers are void (their blocks are freed): they come again."""
        for request_id in preempted_req_ids:
            told = self._noticed.pop(request_id, None)
            if told is not None:
                engine_id, nonce = told
                self._send_notice(engine_id, ReadyNotice(self.ctx.engine_id, request_id, nonce, self.pp_rank, 0, -1, []))

    def _send_notice(self, engine_id: str, notice: ReadyNotice) -> None:
        try:
            msg = notice.encode()
            for rank, _ in self.topology.sources_for(engine_id, self.start_layer, self.end_layer):
                self.transport.send_notif(self._agents[(engine_id, rank)], msg)
        except Exception as e:  # noqa: BLE001 - the consumer pulls nothing: its load times out
            self.log.warning("kv_ready_notice_failed", request_id=notice.request_id, error=repr(e))

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        for request_id in finished_req_ids:  # finished (aborted) mid-prompt: no chunk of it comes again
            self._noticed.pop(request_id, None)
        sending = self._collect_notifications()
        self._quarantine.retry(self.transport)
        for request_id in list(self._pulls):
            pull = self._pulls[request_id]
            states = [self.transport.poll(handle) for handle in pull.handles]
            if TransferState.FAILED in states:
                self.log.warning("kv_pull_failed", request_id=request_id, error="a NIXL read failed")
                self._end_pull(request_id, failed=True)
            elif not pull.awaited_ranks and all(state is TransferState.DONE for state in states):
                self._end_pull(request_id, failed=False)
        recving, self._finished_recving = frozenset(self._finished_recving), set()
        return sending, recving

    def _end_pull(self, request_id: str, failed: bool) -> None:
        pull = self._pulls.pop(request_id)
        remote_request_id = pull.transfer.remote_request_id
        if self._awaiting.get(remote_request_id) == request_id:
            del self._awaiting[remote_request_id]
            if pull.awaited_ranks:  # notices still to come: answer them "not read"
                self._dropped[remote_request_id] = time.monotonic()
        for handle in pull.handles:
            if not self._quarantine.release(self.transport, handle, pull.transfer.block_ids, request_id):
                failed = True
        if failed:
            self._invalid_block_ids.update(pull.transfer.block_ids)
            for agent, notif in pull.notifs:  # a read that ended early may not have notified: free the producer
                self._notify(agent, notif)
        elif pull.transfer.block_ids:
            ready_at = pull.transfer.remote_ready_at
            handover_s = {request_id: time.time() - ready_at} if ready_at else {}
            self._stats = self._stats + KVTransferStats(
                num_blocks_loaded=len(pull.transfer.block_ids),
                num_bytes_loaded=pull.nbytes,
                load_time_s=time.perf_counter() - pull.started_at,
                handover_s=handover_s,
            )
        self._finished_recving.add(request_id)

    def get_quarantined_blocks(self) -> tuple[list[int], list[int]]:
        return self._quarantine.take()

    def _notify(self, agent: str, notif: bytes) -> None:
        try:
            self.transport.send_notif(agent, notif)
        except Exception as e:  # noqa: BLE001 - the producer is gone; its timeout frees its blocks
            self.log.warning("kv_notify_failed", agent=agent, error=repr(e))

    def _collect_notifications(self) -> frozenset[str]:
        """Ready notices start the reads they were awaited for (consumer); returns the held requests
        every reader of this stage has notified (producer)."""
        if self.transport is None:
            return frozenset()
        now = time.monotonic()
        for msg in self.transport.get_notifs():
            ready = ReadyNotice.decode(msg)
            if ready is not None:
                if self.role == "consumer":
                    self._on_ready(ready)
                continue
            parsed = parse_notification(msg)
            if parsed is None or self.role != "producer":
                self.log.warning("kv_bad_notification", message=msg[:100])
                continue
            self._handouts.on_notification(*parsed, now)
        if self.role != "producer":
            self._expire_early_notices(now)
            return frozenset()
        return self._handouts.take_done(now)

    def abort_transfers(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self._pulls:
                self._end_pull(request_id, failed=True)
                self._finished_recving.discard(request_id)  # the wrapper reports it
            self._handouts.forget(request_id)
            self._noticed.pop(request_id, None)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        invalid, self._invalid_block_ids = frozenset(self._invalid_block_ids), set()
        return invalid

    def get_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        return stats

    def close(self) -> None:
        for request_id in list(self._pulls):
            self._end_pull(request_id, failed=True)
        if self.transport is not None:
            self.transport.close()
