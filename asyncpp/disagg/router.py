"""`PDRouter`: one address for clients in front of a prefill engine and a decode engine.

It speaks the engine's client protocol, so a client (or the HTTP front end)
cannot tell it from an engine. Each request is one task:
1. prefill: the client's prompt and sampling params to the prefill engine
   with `max_tokens` 1 and `kv_transfer_params={"do_remote_decode": True}`;
   its one token goes to the client at once (the first token's latency is
   the prefill's). If that token ends the request (a stop token, a stop
   string, EOS) its delta is the client's last; otherwise the delta's
   `kv_transfer_params` say where the prompt's KV waits and which token the
   decode engine continues after. A client asking for one token gets it from
   the prefill engine alone.
2. decode: the client's own request to the decode engine with those params,
   verbatim; its deltas (from the second token on) go back to the client
   unchanged, under the client's request id.
With `handover = "early"` (the default, when both engines publish KV
handshakes) the decode phase starts with the prefill: the decode engine gets
the request at once, awaiting the prefill engine's request
(`{"do_remote_prefill": true, ...}`), so it admits it and reads the prompt's
KV as soon as each prefill stage has computed it (the prefill engine is
asked with `decode_engine_id`); the prefill's last delta's params follow
(`RemotePrefillDone`) and bring the first token. A request that ends at the
prefill aborts its decode request. `"after_prefill"` sends the decode
request only once the prefill is done; one aborted (or failed) after the
prefill handed out its params, before its decode phase began, still goes to
the decode engine, with its abort at once, so that the prefill engine frees
the prompt's blocks now (the decode engine tells it nobody pulls them), not
after `pull_timeout_s`.
Both engines know the request by one id the router makes
(`<client id>.pd<router id>.<n>`), so two clients may use the same id; the
router id is 64 random bits drawn when the router starts, so neither a second
router in front of the same engines nor a restarted one (whose `n` starts
over) makes an id a live request already has. Errors from either
engine reach the client with their kind. An abort (or the client gone) cancels
the task, and cancelling it aborts the request in whichever engine holds it
(`AsyncClient.generate` sends the abort as its stream closes); an abort before
the decode phase starts means it never starts. An engine found dead
(`EngineLink`) fails the requests that need it with "engine_dead" at once,
and new requests are refused until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asyncpp.disagg.link import EngineLink, exchange_handshakes
from asyncpp.disagg.router_base import Routed, RouterBase, engine_stats
from asyncpp.disagg.stats import RouterCounters, merged_stats
from asyncpp.disagg.translate import DO_REMOTE_DECODE, error_reply, handed_on, invalid, prefill_params
from asyncpp.kv_transfer.pd.params import DECODE_ENGINE_ID, AwaitedPrefill
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.client_msgs import ErrorReply, GenerateRequest, StatsReply, StatsRequest
from asyncpp.wire.queues import RouterQueue

REVIVE_TIMEOUT_S = 2.0


@dataclass(eq=False)
class RoutedRequest(Routed):
    phase: str = "prefill"  # "prefill" | "decode"
    prefill_done_at: float = 0.0
    # after_prefill: the prefill engine's params once it handed them out (it holds the prompt's
    # blocks for them), until the decode phase starts.
    handed_out: dict[str, Any] | None = None

    def log_context(self) -> dict[str, Any]:
        return {"phase": self.phase}


class RequestError(Exception):
    """The request is over with this error for its client."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


class PDRouter(RouterBase):
    log_role = "pd_router"
    id_tag = "pd"
    no_remote_engines = "a prefill/decode router has no KV connector: tell its engines"

    def __init__(self, queue: RouterQueue, prefill: EngineLink, decode: EngineLink, handover: str = "early") -> None:
        super().__init__(queue, [prefill, decode], RouterCounters())
        self.prefill = prefill
        self.decode = decode
        self.handover = handover
        self._releases: set[asyncio.Task] = set()  # `_send_and_abort`s under way
        self._exchanging = asyncio.Lock()  # one handshake exchange at a time
        for link in (prefill, decode):
            link.on_dead = self._engine_dead
            link.on_answer = self._engine_answers
            link.on_new_generation = self._new_generation

    @property
    def is_healthy(self) -> bool:
        return self.prefill.is_alive and self.decode.is_alive

    # ---- lifecycle -------------------------------------------------------------------------
    async def connect(self, timeout_s: float) -> None:
        """Start-up: exchange the engines' KV handshakes (waiting for both to answer)."""
        await exchange_handshakes(self.prefill, self.decode, timeout_s)

    # ---- requests (`RouterSink`) -----------------------------------------------------------
    def add_request(self, peer: bytes, msg: GenerateRequest) -> ErrorReply | None:
        rid = msg.request_id
        if msg.kv_transfer_params is not None:
            return invalid(rid, "kv_transfer_params", "set by the prefill/decode router, never by its clients")
        for link in (self.prefill, self.decode):
            if not link.is_alive:
                return ErrorReply(rid, link.dead_message(), "engine_dead")
        if (error := self.refusal(peer, msg)) is not None:
            return error
        try:  # as the engines would: a bad value is refused before a prefill is spent on it
            SamplingParams.from_dict(msg.sampling_params).validate()
        except (TypeError, ValueError) as e:
            return invalid(rid, "sampling_params", str(e))
        req = RoutedRequest(peer, msg, self.engine_request_id(rid))
        self.start(req, self._route(req))
        return None

    @property
    def is_early(self) -> bool:
        """The decode engine gets requests with the prefill engine (both publish KV handshakes)."""
        return self.handover == "early" and self.prefill.engine_id is not None and self.decode.engine_id is not None

    async def _route(self, req: RoutedRequest) -> None:
        is_alone = SamplingParams.from_dict(req.msg.sampling_params).max_tokens == 1
        if self.is_early and not is_alone:
            return await self._route_early(req)
        try:
            kv_transfer_params = await self._run_prefill(req)
            if kv_transfer_params is None or self.requests.get(req.key) is not req:
                return  # over at its first token; or aborted or failed meanwhile
            req.phase = "decode"
            req.handed_out = None  # the decode engine gets them now: it frees them on any path
            if not self.decode.is_alive:
                raise RequestError(ErrorReply(req.msg.request_id, self.decode.dead_message(), "engine_dead"))
            self.counters.num_handovers += 1
            await self._handshake_of(req, kv_transfer_params)
            await self._run_decode(req, kv_transfer_params)
        except RequestError as e:
            self._fail(req, e.reply.message, e.reply.kind, e.reply.field)
        except Exception as e:  # a bug here fails this request, not the router
            self.log.exception("request_routing_failed", request_id=req.engine_request_id, error=repr(e))
            self._fail(req, repr(e), "internal")
        finally:
            if req.handed_out is not None:  # aborted (or failed) between the prefill and the decode
                self._release_handed_out(req)

    def _release_handed_out(self, req: RoutedRequest) -> None:
        """The prefill engine holds the prompt's blocks for params nobody will decode with: the decode
        engine gets the request and its abort at once, and tells the prefill engine's stages that
        nobody pulls them, instead of the blocks staying held for `pull_timeout_s`. On a task of its
        own: the request's task may be cancelled (the abort that brought us here)."""
        params, req.handed_out = req.handed_out, None
        if not self.decode.is_alive:
            return  # the prefill engine's pull_timeout_s frees them
        self.counters.num_released_after_prefill += 1
        task = asyncio.get_running_loop().create_task(self._send_and_abort(req, params))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _send_and_abort(self, req: RoutedRequest, params: dict[str, Any]) -> None:
        msg = req.msg
        stream = self.decode.client.generate(msg.prompt, msg.sampling_params, req.engine_request_id, params)
        first = asyncio.ensure_future(anext(stream))  # its first step sends the request, then awaits a reply
        await asyncio.sleep(0)
        first.cancel()  # the stream then sends the abort (or the request has ended: it was over anyway)
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        self.log.info("handed_out_kv_released", request_id=req.engine_request_id)

    async def _route_early(self, req: RoutedRequest) -> None:
        """Both engines at once: the decode engine awaits the prefill engine's request."""
        awaited = AwaitedPrefill(self.prefill.engine_id, req.engine_request_id).params()
        decode = asyncio.create_task(self._run_decode(req, awaited))
        kv = {**DO_REMOTE_DECODE, DECODE_ENGINE_ID: self.decode.engine_id}
        prefill = asyncio.create_task(self._run_prefill(req, kv, then=self._hand_over))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if not prefill.done():  # the decode engine refused or failed it first: that error ends it
                decode.result()
                raise RequestError(ErrorReply(req.msg.request_id, f"{self.decode.name} ended the request early", "internal"))
            if prefill.result() is None or self.requests.get(req.key) is not req:
                return  # over at its first token (its decode request is aborted); or aborted or failed
            await decode
        except RequestError as e:
            self._fail(req, e.reply.message, e.reply.kind, e.reply.field)
        except Exception as e:  # a bug here fails this request, not the router
            self.log.exception("request_routing_failed", request_id=req.engine_request_id, error=repr(e))
            self._fail(req, repr(e), "internal")
        finally:
            for task in (prefill, decode):
                task.cancel()  # closing its engine stream aborts it there
            await asyncio.gather(prefill, decode, return_exceptions=True)

    async def _hand_over(self, req: RoutedRequest, kv_transfer_params: dict[str, Any]) -> None:
        """Early handover: the decode engine, which awaits the prefill, gets its params."""
        if self.requests.get(req.key) is not req:
            return  # aborted or failed meanwhile
        req.phase = "decode"
        if not self.decode.is_alive:
            raise RequestError(ErrorReply(req.msg.request_id, self.decode.dead_message(), "engine_dead"))
        self.counters.num_handovers += 1
        await self._handshake_of(req, kv_transfer_params)
        await self.decode.client.remote_prefill_done(req.engine_request_id, kv_transfer_params)

    async def _run_prefill(
        self, req: RoutedRequest, kv: dict[str, Any] = DO_REMOTE_DECODE,
        then: Callable[[RoutedRequest, dict[str, Any]], Awaitable[None]] | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """Stream the prefill engine's token to the client; the params to decode with, or None if the
        request is over (one token asked for, or it stopped there). `then` gets the params at once."""
        t0 = time.monotonic()
        msg = req.msg
        is_alone = SamplingParams.from_dict(msg.sampling_params).max_tokens == 1
        params = msg.sampling_params if is_alone else prefill_params(msg.sampling_params)
        kv = None if is_alone else kv
        stream = self.prefill.client.generate(msg.prompt, params, req.engine_request_id, kv)
        async with contextlib.aclosing(stream):
            try:
                async for delta in stream:
                    if not delta.finished:
                        self.front.push_delta(req.peer, msg.request_id, delta)
                        continue
                    req.prefill_done_at = time.monotonic()
                    self.counters.prefill_done(req.prefill_done_at - t0)
                    if delta.kv_transfer_params is not None and not is_alone:
                        if then is None:  # after_prefill: nobody else knows of the blocks held for them
                            req.handed_out = delta.kv_transfer_params
                        self.front.push_delta(req.peer, msg.request_id, handed_on(delta))
                        if then is not None:
                            await then(req, delta.kv_transfer_params)
                        return delta.kv_transfer_params
                    if delta.finish_reason == "length" and not is_alone:
                        raise RequestError(
                            ErrorReply(msg.request_id, f"{self.prefill.name} handed out no KV for the decode", "internal")
                        )
                    self._finished(req)
                    self.front.push_delta(req.peer, msg.request_id, dataclasses.replace(delta, kv_transfer_params=None))
                    return None
            except RequestError:
                raise
            except Exception as e:
                raise RequestError(error_reply(msg.request_id, e, self.prefill.name)) from e
        return None  # the stream ended without a last delta: failed or aborted, handled there

    async def _run_decode(self, req: RoutedRequest, kv_transfer_params: dict[str, Any]) -> None:
        msg = req.msg
        stream = self.decode.client.generate(msg.prompt, msg.sampling_params, req.engine_request_id, kv_transfer_params)
        is_first = True
        async with contextlib.aclosing(stream):
            try:
                async for delta in stream:
                    if is_first:
                        self.counters.second_token_done(time.monotonic() - req.prefill_done_at)
                        is_first = False
                    if delta.finished:
                        self._finished(req)
                    self.front.push_delta(req.peer, msg.request_id, delta)
            except Exception as e:
                raise RequestError(error_reply(msg.request_id, e, self.decode.name)) from e

    # ---- engines ---------------------------------------------------------------------------
    def _engine_dead(self, link: EngineLink) -> None:
        # Every request needs the decode engine; only those still prefilling need the prefill one.
        for req in list(self.requests.values()):
            if link is self.decode or req.phase == "prefill":
                self._fail(req, link.dead_message(), "engine_dead")

    async def _engine_answers(self, link: EngineLink) -> bool:
        """A dead engine answers again (restarted): it serves once the handshakes are exchanged
        anew; with the other engine dead too, that waits for the other's return."""
        other = self.decode if link is self.prefill else self.prefill
        if other.is_alive:
            try:
                async with self._exchanging:
                    await exchange_handshakes(self.prefill, self.decode, REVIVE_TIMEOUT_S)
            except (TimeoutError, RuntimeError) as e:
                self.log.warning("engine_revival_failed", engine=link.role, error=str(e))
                return False
        return True

    async def _new_generation(self, link: EngineLink) -> None:
        """An engine's stages were restarted (its health says so): their KV memory is new, so both
        engines get the other's handshake again (the unchanged one is a no-op there)."""
        self.log.info("engine_stages_restarted", engine=link.role, generation=link.reported_generation)
        try:
            async with self._exchanging:
                if link.reported_generation != link.kv_generation:
                    await exchange_handshakes(self.prefill, self.decode, REVIVE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as e:  # asked again at the next health check
            self.log.warning("kv_handshake_renewal_failed", engine=link.role, error=str(e))

    async def _handshake_of(self, req: RoutedRequest, kv_transfer_params: dict[str, Any]) -> None:
        """The producer's params come from stages the decode engine has no handshake of yet (restarted
        since the last exchange): exchange first, or the decode engine refuses them."""
        generation = kv_transfer_params.get("generation")
        if not isinstance(generation, int) or generation == self.prefill.kv_generation:
            return
        async with self._exchanging:
            if generation == self.prefill.kv_generation:
                return
            try:
                await exchange_handshakes(self.prefill, self.decode, REVIVE_TIMEOUT_S)
            except (TimeoutError, RuntimeError) as e:
                message = f"the KV handshakes could not be exchanged after {self.prefill.name}'s stages restarted: {e}"
                raise RequestError(ErrorReply(req.msg.request_id, message, "engine_dead")) from e

    # ---- request/reply ---------------------------------------------------------------------
    async def _stats(self, msg: StatsRequest) -> StatsReply:
        prefill, decode = await asyncio.gather(engine_stats(self.prefill), engine_stats(self.decode))
        router = {
            **self.counters.stats(),
            "pd_num_unfinished": len(self.requests),
            "pd_engines": {
                link.role: {"address": link.address, "dead_reason": link.dead_reason} for link in (self.prefill, self.decode)
            },
            "is_dead": not self.is_healthy,
            "run_id": self.router_id,  # the router's, as an engine's names its run (not the decode engine's)
        }
        return StatsReply(msg.nonce, merged_stats(prefill, decode, router))
