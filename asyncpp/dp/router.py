"""`DPRouter`: one address for clients in front of N replicas of one engine (data parallelism).

It speaks the engine's client protocol, so a client (or the HTTP front end)
cannot tell it from an engine. Each request goes whole to one replica: the
live one that would sample its first token soonest, by the prompt tokens
queued there and its requests decoding (`placement.py`), then the fewest
unfinished, then the next in turn (so equal loads alternate). With a
long-prompt replica (an engine of several stages over every core), prompts of
at least its `min_tokens` go to it and the others to the rest. The replicas
run the same config but for that one's `pp_size`, and every path of an engine
is batch-invariant at any pp size, so which replica serves a request never
changes its tokens. The request goes as the client sent it (prompt, sampling
params, `kv_transfer_params`) under an id the router makes
(`<client id>.dp<router id>.<n>`: two clients may use the same id, and no
other router, nor this one restarted, makes an id a live request already has);
the replica's deltas come back unchanged under the client's id, and its errors
with their kind.

An abort (or the client gone) cancels the request's task, which aborts it in
its replica (`AsyncClient.generate` sends the abort as its stream closes). A
replica found dead (`EngineLink`: no health reply, or its process gone) fails
its own requests with "engine_dead" at once; new requests go to the others,
and it takes requests again once it answers healthy (restarted at the same
address). The router reports itself healthy only while every replica is, as
an engine whose part is lost would; it is dead when none is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

from asyncpp.disagg.link import EngineLink
from asyncpp.disagg.router_base import Routed, RouterBase, engine_stats
from asyncpp.disagg.translate import error_reply
from asyncpp.dp.placement import LongPrompts, ReplicaLoads, prompt_tokens
from asyncpp.dp.stats import RouterCounters, merged_stats
from asyncpp.wire.client_msgs import ErrorReply, GenerateRequest, StatsReply, StatsRequest
from asyncpp.wire.queues import RouterQueue

LOG_ROLE = "dp_router"


@dataclass(eq=False)
class ReplicaRequest(Routed):
    replica: int = 0  # index into `DPRouter.replicas`
    prompt_tokens: int = 0  # as `ReplicaLoads` counts it
    prefilled: bool = False  # its first delta came back

    def log_context(self) -> dict[str, Any]:
        return {"replica": self.replica}


class DPRouter(RouterBase):
    log_role = LOG_ROLE
    id_tag = "dp"
    no_remote_engines = "a data-parallel router takes no remote engines"

    def __init__(
        self, queue: RouterQueue, replicas: list[EngineLink], step_budget: int, long_prompts: LongPrompts | None = None
    ) -> None:
        """`step_budget`: the replicas' `scheduler.max_num_batched_tokens`; `long_prompts`: which of
        `replicas` takes the long prompts (None: none does)."""
        if not replicas:
            raise ValueError("a data-parallel router needs at least one replica")
        if long_prompts is not None and not 0 <= long_prompts.replica < len(replicas):
            raise ValueError(f"no replica {long_prompts.replica} for the long prompts among {len(replicas)}")
        super().__init__(queue, replicas, RouterCounters())
        self.replicas = replicas
        self.long_prompts = long_prompts
        self.loads = ReplicaLoads(len(replicas), step_budget)
        self.num_routed = [0] * len(replicas)
        for link in replicas:
            link.on_dead = self._replica_dead
            link.on_answer = self._replica_answers

    @property
    def is_healthy(self) -> bool:
        return all(link.is_alive for link in self.replicas)

    async def connect(self, timeout_s: float) -> None:
        """Start-up: wait until every replica answers healthy; `TimeoutError` naming those that do not."""
        deadline = time.monotonic() + timeout_s
        while True:
            reasons = await asyncio.gather(*(link.check() for link in self.replicas))
            silent = [f"{link.name}: {why}" for link, why in zip(self.replicas, reasons) if why is not None]
            if not silent:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"replicas not healthy within {timeout_s:g} s: {'; '.join(silent)}")
            await asyncio.sleep(0.1)

    # ---- requests (`RouterSink`) -----------------------------------------------------------
    def add_request(self, peer: bytes, msg: GenerateRequest) -> ErrorReply | None:
        if (error := self.refusal(peer, msg)) is not None:
            return error
        tokens = prompt_tokens(msg.prompt)
        live = [link.is_alive for link in self.replicas]
        replica = self.loads.choose(self.long_prompts.eligible(live, tokens) if self.long_prompts else live, tokens)
        if replica is None:
            reasons = "; ".join(link.dead_message() for link in self.replicas)
            return ErrorReply(msg.request_id, f"every replica is dead: {reasons}", "engine_dead")
        req = ReplicaRequest(peer, msg, self.engine_request_id(msg.request_id), replica=replica, prompt_tokens=tokens)
        self.loads.queued(replica, tokens)
        self.num_routed[replica] += 1
        self.start(req, self._route(req))
        return None

    @property
    def num_unfinished(self) -> list[int]:
        """The router's requests on each replica."""
        return [self.loads.num_unfinished(i) for i in range(len(self.replicas))]

    async def _route(self, req: ReplicaRequest) -> None:
        link, msg = self.replicas[req.replica], req.msg
        stream = link.client.generate(msg.prompt, msg.sampling_params, req.engine_request_id, msg.kv_transfer_params)
        async with contextlib.aclosing(stream):
            try:
                async for delta in stream:
                    if not req.prefilled:
                        req.prefilled = True
                        self.loads.prefilled(req.replica, req.prompt_tokens)
                    if delta.finished:
                        self._finished(req)
                    self.front.push_delta(req.peer, msg.request_id, delta)
            except Exception as e:  # the replica's error (or a dead replica's), with its kind
                reply = error_reply(msg.request_id, e, link.name, params_from_router=False)
                self._fail(req, reply.message, reply.kind, reply.field)

    def _forget(self, req: ReplicaRequest) -> None:
        super()._forget(req)
        self.loads.ended(req.replica, req.prompt_tokens, req.prefilled)

    # ---- replicas --------------------------------------------------------------------------
    def _replica_dead(self, link: EngineLink) -> None:
        index = self.replicas.index(link)
        for req in [r for r in self.requests.values() if r.replica == index]:
            self._fail(req, link.dead_message(), "engine_dead")

    async def _replica_answers(self, link: EngineLink) -> bool:
        """A dead replica answers healthy again (restarted at its address): it takes requests again."""
        return True

    # ---- request/reply ---------------------------------------------------------------------
    async def _stats(self, msg: StatsRequest) -> StatsReply:
        replicas = await asyncio.gather(*(engine_stats(link) for link in self.replicas))
        router = {
            **self.counters.stats(),
            "dp_size": len(self.replicas) - (self.long_prompts is not None),
            "dp_long_prompts": asdict(self.long_prompts) if self.long_prompts else None,
            "dp_num_unfinished": self.num_unfinished,
            "dp_queued_prompt_tokens": list(self.loads.queued_tokens),
            "dp_num_decoding": list(self.loads.num_decoding),
            "dp_num_routed": list(self.num_routed),
            "dp_replicas": [{"address": link.address, "dead_reason": link.dead_reason} for link in self.replicas],
            "is_dead": not any(link.is_alive for link in self.replicas),
            "run_id": self.router_id,  # the router's, as an engine's names its run
        }
        return StatsReply(msg.nonce, merged_stats(list(replicas), router))
