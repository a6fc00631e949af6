"""`PDScheduler`: the engine side of prefill/decode disaggregation, as producer or consumer.

Producer (`kv_role = "producer"`, the prefill engine): a request asked for
with `{"do_remote_decode": true}` runs its prompt and samples one token like
any other; when it finishes at its length (not at a stop: then the client's
request is over), `request_finished` keeps every block of its prompt (the
engine holds them) and hands out signed `kv_transfer_params` (`pd.params`)
with the request's last delta: the blocks and the token it sampled. Every stage reports the request
in `finished_sending` once every consumer stage that reads its layers has
said it is done (a notification with each pull), and the engine frees the
blocks; a request nobody pulls is aborted after `kv_transfer.pull_timeout_s`
(the engine's send deadline, `send_timeout_s`), with a warning.

Consumer (`kv_role = "consumer"`, the decode engine): a request whose
`kv_transfer_params` name a known producer and pass `RemotePrefill.check`
(otherwise it is refused at `add_request`), and whose nonce was not accepted
here before (`claim_kv_transfer_params` remembers it until it expires), starts with the producer's token
as its first output (`remote_output_token_ids`; the client has it already)
and is offered the prompt's blocks beyond its own prefix-cache hit, the last
one partly filled: every stage pulls the blocks of its layers from every
producer stage that holds them (`TransferTopology`), while the request waits
in `WAITING_FOR_REMOTE_KVS`; it is scheduled once every stage has its blocks.
No stage ever waits for a read: a hung producer costs only its own requests,
whose pulls fail at `load_timeout_s` (the engine's load deadline) and fail
them with an error (`load_failure_policy`). A
request whose blocks it does not pull (its own cache had them, it was aborted
first) still tells the producer, so that no block waits for its timeout.

Early handover (`AwaitedPrefill` params, what the router sends): the
consumer admits the request (one at a time per producer request: its KV is
read once) while the producer computes its prompt, with
its prompt's blocks allocated and one pull per stage awaiting the producer
stages' word (`on_ready`); the request stays parked once loaded, until its
signed params come (`accept_remote_prefill`). A producer request asked for
with `decode_engine_id` has every stage tell that engine's stages where its
prompt's KV is, right after each forward that computed a chunk of it (a save).

Both: every stage's handshake (`set_xfer_handshake_metadata_pp_aware`, any
pp_size) makes this engine's `EngineHandshake`; a remote engine's handshake
(`add_remote_engine`) is checked against the model's layers and block
geometry and reaches every stage with the next plan.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from asyncpp.config import ConfigError
from asyncpp.core.request import RequestStatus
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorScheduler, PlanInfo
from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVConnectorOutput
from asyncpp.kv_transfer.pd.params import (
    DECODE_ENGINE_ID,
    DO_REMOTE_DECODE,
    AwaitedPrefill,
    RemotePrefill,
    tokens_digest,
)
from asyncpp.kv_transfer.pd.topology import TransferTopology
from asyncpp.logging import get_logger
from asyncpp.transport.nixl_agent import nixl_available

if TYPE_CHECKING:
    from asyncpp.core.request import Request

ROLES = ("producer", "consumer")


class PDScheduler(KVConnectorScheduler):
    load_failure_policy = "fail"  # a pull that fails (the producer is gone) fails its request
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        if ctx.kv_role not in ROLES:
            raise ConfigError(f"kv_transfer.kv_role must be 'producer' or 'consumer' for the pd connector, got {ctx.kv_role!r}")
        if not nixl_available():  # else every stage would die at start-up importing it
            raise ConfigError("kv_transfer.connector = 'pd' moves KV through NIXL, which is not installed: "
                              "pip install 'asyncpp[pd]' (nixl-cu12)")  # fmt: skip
        self.role = ctx.kv_role
        pull = ctx.extra.get("pull", "async")
        if pull != "async":
            # A pull within a plan made every stage wait for its read before the forward: one hung
            # producer stalled every request of this engine for load_timeout_s.
            raise ConfigError(f"kv_transfer.options.pull: pulls are always 'async' (a request waits for its pull "
                              f"outside the step loop), got {pull!r}")  # fmt: skip
        self.engine_id = ctx.engine_id
        self._params_key = secrets.token_bytes(32)
        self._stages: dict[tuple[int, int], KVHandshakeMetadata] = {}
        num_layers = ctx.layer_ranges[-1][1]
        self.topology = TransferTopology(ctx.engine_id, ctx.block_size, ctx.dtype, num_layers)
        self._remote: dict[str, EngineHandshake] = {}
        self._unsent_remote: list[EngineHandshake] = []
        self._unsent_transfers: list[BlockTransfer] = []  # consumer: pulls, and releases without a pull
        self._resolved: set[str] = set()  # consumer: unfinished requests with params, pulled or released
        self._bound: dict[str, BlockTransfer] = {}  # consumer: unfinished requests -> the pull bound for them
        self._compute_here: set[str] = set()  # consumer: unfinished requests that pull no more (a restart)
        self._first_token_at: dict[str, float] = {}  # consumer: awaited requests whose params came
        self._used_nonces: dict[str, float] = {}  # consumer: nonces of params accepted here -> their expiry
        self._awaited: set[tuple[str, str]] = set()  # consumer: (producer, its request) an unfinished request awaits
        self._nonces: dict[str, str] = {}  # producer: unfinished request -> the nonce of its handout
        self._unsent_nonces: dict[str, str] = {}  # producer: handed out since the last plan
        self.num_handed_out = 0  # producer: params handed out
        self.num_pulls = 0  # consumer: requests pulled
        self.num_pulled_tokens = 0
        self.num_released_unpulled = 0  # consumer: told the producer without pulling
        self.num_early_handovers = 0  # consumer: awaited requests whose producer params came
        self.num_refused_replays = 0  # consumer: params refused because their nonce was used here before
        self.num_computed_here = 0  # consumer: requests computed here after all (a restart on either side)
        self.log = get_logger(role="engine", connector="pd", kv_role=self.role, engine_id=self.engine_id)

    @property
    def send_timeout_s(self) -> float:
        return self.ctx.pull_timeout_s

    # ---- handshakes ------------------------------------------------------------------------
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVHandshakeMetadata]) -> None:
        expected = {(rank, 0) for rank in range(self.ctx.pp_size)}
        if set(metadata) != expected:
            raise ValueError(f"pd connector: handshakes of (pp_rank, tp_rank) {sorted(metadata)}, expected {sorted(expected)}")
        for (rank, _), md in metadata.items():
            if (md.start_layer, md.end_layer) != tuple(self.ctx.layer_ranges[rank]):
                raise ValueError(
                    f"pd connector: stage {rank} published layers [{md.start_layer}, {md.end_layer}), "
                    f"it owns {list(self.ctx.layer_ranges[rank])}"
                )
        self._stages = dict(metadata)

    def engine_handshake(self) -> EngineHandshake | None:
        if not self._stages:
            return None
        return EngineHandshake.of(self.engine_id, self._stages, self._params_key, self.generation)

    def add_remote_engine(self, handshake: EngineHandshake) -> None:
        if handshake.engine_id == self.engine_id:
            raise ValueError(f"remote engine id {handshake.engine_id!r} is this engine's own")
        if not handshake.params_key:
            raise ValueError(f"remote engine {handshake.engine_id!r} has no params key")
        if self._remote.get(handshake.engine_id) == handshake:
            return  # given again unchanged (the other engine's stages were restarted): its reads go on
        self.topology.register_remote_engine(handshake)  # checks layers, block size, dtype
        self._remote[handshake.engine_id] = handshake
        self._unsent_remote.append(handshake)

    # ---- requests --------------------------------------------------------------------------
    def validate_kv_transfer_params(self, params: dict[str, Any], prompt_token_ids: list[int]) -> None:
        if self.role == "producer":
            if _is_producer_params(params):
                decode_engine_id = params.get(DECODE_ENGINE_ID)
                if decode_engine_id is not None and decode_engine_id not in self._remote:
                    raise ValueError(f"kv_transfer_params.{DECODE_ENGINE_ID}: engine {decode_engine_id!r} is not known here")
                return
            raise ValueError(
                f'a producer takes kv_transfer_params {{"{DO_REMOTE_DECODE}": true}} and an optional '
                f'"{DECODE_ENGINE_ID}" only, got {params!r}'
            )
        if AwaitedPrefill.is_awaited(params):
            awaited = AwaitedPrefill.parse(params)
            if awaited.remote_engine_id not in self._remote:
                raise ValueError(f"kv_transfer_params name engine {awaited.remote_engine_id!r}, which this engine does not know")
            if (awaited.remote_engine_id, awaited.remote_request_id) in self._awaited:  # its one reader is here
                raise ValueError(
                    f"kv_transfer_params: engine {awaited.remote_engine_id!r}'s request {awaited.remote_request_id!r} "
                    "is awaited by another request here already (its KV is read once)"
                )
            return
        prefill = RemotePrefill.parse(params)
        self._check(prefill, params, prompt_token_ids)

    def _check(self, prefill: RemotePrefill, params: dict[str, Any], prompt_token_ids: list[int]) -> None:
        remote = self._remote.get(prefill.remote_engine_id)
        if remote is None:
            raise ValueError(f"kv_transfer_params name engine {prefill.remote_engine_id!r}, which this engine does not know")
        if prefill.generation != remote.generation:
            raise ValueError(
                f"kv_transfer_params are from generation {prefill.generation} of engine {prefill.remote_engine_id!r}'s "
                f"stages, this engine knows generation {remote.generation}: its stages were restarted and "
                + ("the blocks are gone" if prefill.generation < remote.generation else "its handshake is not here yet")
            )
        num_remote_blocks = min(stage.num_blocks for stage in remote.stages)
        now = time.time()
        key, block_size = remote.params_key, self.ctx.block_size
        prefill.check(params["sig"], key, block_size, prompt_token_ids, num_remote_blocks, self.engine_id, now)
        for nonce in [n for n, expires_at in self._used_nonces.items() if expires_at < now]:
            del self._used_nonces[nonce]  # expired: refused as such from now on
        if prefill.nonce in self._used_nonces:
            self.num_refused_replays += 1
            raise ValueError(
                f"kv_transfer_params (nonce {prefill.nonce}) were used here already: each handout is read once "
                f"(engine {prefill.remote_engine_id!r} may have reused their blocks)"
            )

    def claim_kv_transfer_params(self, params: dict[str, Any]) -> None:
        if self.role != "consumer":
            return
        if AwaitedPrefill.is_awaited(params):
            awaited = AwaitedPrefill.parse(params)
            self._awaited.add((awaited.remote_engine_id, awaited.remote_request_id))
            return
        try:
            prefill = RemotePrefill.parse(params)
        except (TypeError, ValueError):  # a multi-connector's params for another child
            return
        self._used_nonces[prefill.nonce] = prefill.expires_at

    def remote_output_token_ids(self, params: dict[str, Any]) -> list[int]:
        if self.role != "consumer" or AwaitedPrefill.is_awaited(params):
            return []
        try:
            return [RemotePrefill.parse(params).first_token_id]
        except (TypeError, ValueError):  # a multi-connector's params for another child
            return []

    def awaits_remote_prefill(self, params: dict[str, Any]) -> bool:
        return self.role == "consumer" and AwaitedPrefill.is_awaited(params)

    def accept_remote_prefill(self, request: "Request", params: dict[str, Any]) -> list[int]:
        if not self.awaits_remote_prefill(request.kv_transfer_params or {}):
            raise ValueError(f"request {request.request_id!r} awaits no remote prefill")
        done = RemotePrefill.parse(params)
        AwaitedPrefill.parse(request.kv_transfer_params).check_done(done)
        self._check(done, params, request.prompt_token_ids)
        self._used_nonces[done.nonce] = done.expires_at
        self._first_token_at[request.request_id] = done.first_token_at
        self.num_early_handovers += 1
        return [done.first_token_id]

    def _remote_prefill(self, request: "Request") -> RemotePrefill | AwaitedPrefill | None:
        if self.role != "consumer" or request.kv_transfer_params is None:
            return None
        if AwaitedPrefill.is_awaited(request.kv_transfer_params):
            return AwaitedPrefill.parse(request.kv_transfer_params)
        return RemotePrefill.parse(request.kv_transfer_params)  # checked at add_request

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        prefill = self._remote_prefill(request)
        if prefill is None or request.num_preemptions or request.request_id in self._compute_here:
            return 0, False  # preempted or restarted: its pulled blocks are gone, compute
        if isinstance(prefill, RemotePrefill) and prefill.generation != self._remote[prefill.remote_engine_id].generation:
            # The producer's stages were restarted since: the blocks are gone, and its new stages'
            # memory must never be read under these params. The prompt and first token are all it needs.
            self.log.warning("pd_params_outlived", request_id=request.request_id, generation=prefill.generation)
            self._compute_here.add(request.request_id)
            self.num_computed_here += 1
            return 0, False
        if isinstance(prefill, AwaitedPrefill):  # the whole prompt, as soon as the producer has it
            num_tokens = request.num_prompt_tokens - num_computed_tokens
            return (num_tokens, True) if num_tokens > 0 else (0, False)
        num_tokens = prefill.num_tokens - num_computed_tokens  # the last block may be partly filled
        return (num_tokens, True) if num_tokens > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        prefill = self._remote_prefill(request)
        if prefill is None or num_external_tokens <= 0:
            return
        block_size = self.ctx.block_size
        first = request.num_computed_tokens // block_size
        num_blocks = -(-(request.num_computed_tokens + num_external_tokens) // block_size) - first
        if isinstance(prefill, AwaitedPrefill):  # read once the producer's stages say where
            how = {"on_ready": True, "num_tokens": request.num_prompt_tokens, "remote_first_block": first}
        else:
            how = {
                "remote_block_ids": prefill.remote_block_ids[first : first + num_blocks],
                "remote_ready_at": prefill.first_token_at,
                "nonce": prefill.nonce,
            }
        pull = BlockTransfer(
            request.request_id,
            block_ids[first : first + num_blocks],
            [],
            remote_engine_id=prefill.remote_engine_id,
            remote_request_id=prefill.remote_request_id,
            **how,
        )
        self._unsent_transfers.append(pull)
        self._bound[request.request_id] = pull
        self._resolved.add(request.request_id)
        self.num_pulls += 1
        self.num_pulled_tokens += num_external_tokens

    def _release_unpulled(self, request: "Request") -> None:
        """The producer's blocks for this request will not be pulled: tell its stages now."""
        prefill = self._remote_prefill(request)
        if prefill is None or request.request_id in self._resolved:
            return
        self._resolved.add(request.request_id)
        self._unsent_transfers.append(
            BlockTransfer(
                request.request_id, [], [],
                remote_engine_id=prefill.remote_engine_id, remote_request_id=prefill.remote_request_id,
                nonce=prefill.nonce if isinstance(prefill, RemotePrefill) else "",
            )  # fmt: skip
        )
        self.num_released_unpulled += 1

    def build_connector_meta(self, plan: PlanInfo) -> KVConnectorMetadata:
        handover_at: dict[str, float] = {}
        ready: list[BlockTransfer] = []
        for request, start, num_tokens in plan.scheduled:
            if self.role == "consumer":
                # Scheduled without a pull (its own prefix cache had the blocks): release them.
                self._release_unpulled(request)
                if (at := self._first_token_at.pop(request.request_id, None)) is not None:
                    handover_at[request.request_id] = at  # its first step after an early handover
            elif start < request.num_prompt_tokens and _is_producer_params(request.kv_transfer_params):
                decode_engine_id = request.kv_transfer_params.get(DECODE_ENGINE_ID)
                if decode_engine_id is not None:  # a chunk of its prompt: tell the decode stages once computed
                    num_ready = min(start + num_tokens, request.num_prompt_tokens)
                    num_blocks = -(-num_ready // self.ctx.block_size)
                    ready.append(
                        BlockTransfer(
                            request.request_id, list(plan.block_ids[request.request_id][:num_blocks]), [],
                            remote_engine_id=decode_engine_id, remote_request_id=request.request_id,
                            num_tokens=request.num_prompt_tokens, num_ready_tokens=num_ready,
                            nonce=self._nonce_of(request.request_id),
                        )  # fmt: skip
                    )
        transfers, self._unsent_transfers = self._unsent_transfers, []
        remote, self._unsent_remote = self._unsent_remote, []
        nonces, self._unsent_nonces = self._unsent_nonces, {}
        return KVConnectorMetadata(
            loads=transfers, saves=ready, remote_engines=remote, handover_at=handover_at, send_nonces=nonces
        )

    def _nonce_of(self, request_id: str) -> str:
        """The nonce of this producer request's handout, made when first needed (a ready notice names it)."""
        return self._nonces.setdefault(request_id, secrets.token_hex(16))

    def has_unsent_metadata(self) -> bool:
        return bool(self._unsent_transfers or self._unsent_remote or self._unsent_nonces)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.role == "consumer":
            self._release_unpulled(request)  # if it finished before it was ever scheduled
            if AwaitedPrefill.is_awaited(request.kv_transfer_params):
                awaited = AwaitedPrefill.parse(request.kv_transfer_params)
                self._awaited.discard((awaited.remote_engine_id, awaited.remote_request_id))
            self._resolved.discard(request.request_id)
            self._bound.pop(request.request_id, None)
            self._compute_here.discard(request.request_id)
            self._first_token_at.pop(request.request_id, None)
            return False, None
        if not _is_producer_params(request.kv_transfer_params):
            return False, None
        nonce = self._nonces.pop(request.request_id, None) or secrets.token_hex(16)
        if request.status is not RequestStatus.FINISHED_LENGTH or request.num_output_tokens != 1:
            return False, None  # stopped (the client's request is over there), aborted or failed
        num_blocks = -(-request.num_prompt_tokens // self.ctx.block_size)
        if num_blocks > len(block_ids):
            return False, None
        now = time.time()
        prefill = RemotePrefill(
            self.engine_id,
            request.request_id,
            list(block_ids[:num_blocks]),
            request.num_prompt_tokens,
            tokens_digest(request.prompt_token_ids),
            request.output_token_ids[0],
            now,
            consumer_engine_id=self._consumer_of(request.kv_transfer_params),
            expires_at=now + self.ctx.pull_timeout_s,  # then the engine aborts the hold, frees the blocks
            nonce=nonce,
            generation=self.generation,
        )
        self._unsent_nonces[request.request_id] = nonce
        self.num_handed_out += 1
        return True, prefill.signed(self._params_key)

    # ---- a stage restart -------------------------------------------------------------------
    can_forget_transfers = True

    def forget_transfers(self) -> None:
        """This engine's stages died with their pulls, reads and notices (`asyncpp.runtime.recovery`).

        Producer: every block held for a handout is gone. The generation goes up and the params key
        changes, so that a consumer given the new handshake refuses params handed out before, and
        never reads the new stages' memory under them (`RemotePrefill.generation`).
        Consumer: a request whose pull was bound (half read, or read and its producer told) computes
        its prompt here instead of pulling again (its producer may have freed the blocks since); its
        producer is told once more that nobody reads them (a second word from a stage counts once).
        A request not bound to a pull yet pulls as before.
        Both: no handshake until the new stages publish theirs, and the new stages learn every
        remote engine again with their first plan."""
        self.generation += 1
        self._stages = {}
        self._unsent_remote = list(self._remote.values())
        self._unsent_transfers = [t for t in self._unsent_transfers if not t.block_ids]  # releases still go
        if self.role == "producer":
            self._params_key = secrets.token_bytes(32)
            self._nonces.clear()
            self._unsent_nonces.clear()
        for request_id, pull in self._bound.items():
            self._unsent_transfers.append(
                BlockTransfer(
                    request_id, [], [], remote_engine_id=pull.remote_engine_id,
                    remote_request_id=pull.remote_request_id, nonce=pull.nonce,
                )  # fmt: skip
            )
        self._compute_here |= set(self._bound)
        self.num_computed_here += len(self._bound)
        self.log.info("pd_transfers_forgotten", generation=self.generation, num_computed_here=len(self._bound))
        self._bound.clear()

    def _consumer_of(self, params: dict[str, Any]) -> str:
        """The engine the params are handed to: the one the request names, else the only consumer this
        engine knows, else "" (any engine that knows this one, once)."""
        if (decode_engine_id := params.get(DECODE_ENGINE_ID)) is not None:
            return decode_engine_id
        return next(iter(self._remote)) if len(self._remote) == 1 else ""

    def stats(self) -> dict[str, Any]:
        return {
            "pd_role": self.role,
            "pd_engine_id": self.engine_id,
            "pd_remote_engines": sorted(self._remote),
            "pd_num_handed_out": self.num_handed_out,
            "pd_num_pulls": self.num_pulls,
            "pd_num_pulled_tokens": self.num_pulled_tokens,
            "pd_num_released_unpulled": self.num_released_unpulled,
            "pd_num_early_handovers": self.num_early_handovers,
            "pd_num_refused_replays": self.num_refused_replays,
            "pd_num_computed_here": self.num_computed_here,
            "pd_generation": self.generation,
        }


def _is_producer_params(params: Any) -> bool:
    return (
        isinstance(params, dict)
        and params.get(DO_REMOTE_DECODE) is True
        and set(params) <= {DO_REMOTE_DECODE, DECODE_ENGINE_ID}
        and isinstance(params.get(DECODE_ENGINE_ID, ""), str)
    )
