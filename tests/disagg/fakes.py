"""In-process fake engines for the router's tests: asyncio servers on a `RouterQueue` that speak
the client protocol, record what they get and answer as a prefill or a decode engine would.

* prefill: one finished delta per request (token 7, finished by its length) with
  `kv_transfer_params` {"x": 1}: the client gets it as its first, unfinished delta;
* decode: three deltas (`decode_deltas`: logprobs, a stop string, its own last params), once its
  `kv_transfer_params` are checked to be the ones the prefill handed out.
A decode engine given awaited params (`{"do_remote_prefill": true, ...}`, the early handover)
waits for the request's `RemotePrefillDone` and checks its params instead.
The prompt "prefill error" ("decode error") makes that engine answer `FakeEngine.error` instead. `gate` (cleared) holds a
role's requests before their first delta (prefill) or after it (decode) until set, so a test
can act in either phase; `first_gate` (cleared) holds a decode engine's before their first delta. `kill()` stops answering anything, as a killed process would.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.wire.client_msgs import (
    AbortRequest,
    AddRemoteEngine,
    AddRemoteEngineReply,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    KVHandshakeReply,
    KVHandshakeRequest,
    RemotePrefillDone,
    RequestDelta,
    RequestDeltas,
    StatsReply,
    StatsRequest,
)
from asyncpp.wire.client_auth import ClientAccess
from asyncpp.wire.queues import RouterQueue
from asyncpp.worker.outputs import Logprobs

PREFILL_PARAMS = {"x": 1}


def client_deltas(request_id: str) -> list[RequestDelta]:
    """What a client gets: the prefill engine's token, then the decode engine's deltas."""
    return [RequestDelta(request_id, "z", [7], num_prompt_tokens=5), *decode_deltas(request_id)]


def decode_deltas(request_id: str) -> list[RequestDelta]:
    """What the fake decode engine streams for a request (the router must pass it on unchanged)."""
    return [
        RequestDelta(request_id, "a", [1], logprobs=[Logprobs(-0.5, [1, 4], [-0.5, -1.5])], num_prompt_tokens=5),
        RequestDelta(request_id, "b", [2], num_prompt_tokens=5),
        RequestDelta(request_id, "c", [3], True, "stop", "c", None, 5, 4, {"decode": "done"}),
    ]


ENGINE_SECRET = "fake-deployment-engine-secret"  # what the routers under test present

class FakeEngine:
    def __init__(self, role: str, handshake: EngineHandshake | None = None) -> None:
        self.role = role
        self.queue = RouterQueue("tcp://127.0.0.1:0", 1 << 20, ClientAccess(engine_secret=ENGINE_SECRET))
        self.handshake = handshake
        self.received: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.remote_engines: list[EngineHandshake] = []
        self.is_healthy = True
        self.kv_generation = 0  # what its health says (a restart of its stages raises it)
        self.stats: dict[str, Any] = {"num_running": 0, "num_waiting": 0, "role": role}
        self.kv_transfer_params: dict[str, Any] | None = PREFILL_PARAMS  # prefill: what it hands out
        self.finish_reason = "length"  # prefill: why its one token ends its request
        self.expected_params: dict[str, Any] | None = PREFILL_PARAMS  # decode: what it must get
        self.error = ErrorReply(None, "prompt: the fake refuses it", "invalid_request", "prompt")
        self.gate = asyncio.Event()
        self.gate.set()
        self.first_gate = asyncio.Event()
        self.first_gate.set()
        self.num_handshake_requests = 0
        self.prefills_done: list[RemotePrefillDone] = []  # decode: the early handovers it got
        self._awaited: dict[str, asyncio.Future] = {}
        self._requests: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.queue.address

    def start(self) -> FakeEngine:
        self._task = asyncio.create_task(self._serve())
        return self

    def kill(self) -> None:
        """Answer nothing from now on (the socket stays bound: ZMQ just never hears back)."""
        self._task.cancel()
        for task in self._requests.values():
            task.cancel()

    def close(self) -> None:
        self.kill()
        self.queue.close()

    async def _serve(self) -> None:
        while True:
            peer, msg = await self.queue.get()
            if isinstance(msg, GenerateRequest):
                self.received.append(msg)
                self._requests[msg.request_id] = asyncio.create_task(self._generate(peer, msg))
            elif isinstance(msg, RemotePrefillDone):
                self.prefills_done.append(msg)
                awaited = self._awaited.pop(msg.request_id, None)
                if awaited is not None and not awaited.done():
                    awaited.set_result(msg.kv_transfer_params)
            elif isinstance(msg, AbortRequest):
                self.aborted.append(msg.request_id)
                task = self._requests.pop(msg.request_id, None)
                if task is not None:
                    task.cancel()
            elif isinstance(msg, HealthRequest):
                await self.queue.put(peer, HealthReply(msg.nonce, self.is_healthy, self.kv_generation))
            elif isinstance(msg, StatsRequest):
                await self.queue.put(peer, StatsReply(msg.nonce, self.stats))
            elif isinstance(msg, KVHandshakeRequest):
                self.num_handshake_requests += 1
                await self.queue.put(peer, KVHandshakeReply(msg.nonce, self.handshake))
            elif isinstance(msg, AddRemoteEngine):
                self.remote_engines.append(msg.handshake)
                await self.queue.put(peer, AddRemoteEngineReply(msg.nonce))

    async def _generate(self, peer: bytes, msg: GenerateRequest) -> None:
        rid = msg.request_id
        if msg.prompt == f"{self.role} error":
            await self.queue.put(peer, ErrorReply(rid, self.error.message, self.error.kind, self.error.field))
            return
        if self.role == "prefill":
            await self.gate.wait()
            delta = RequestDelta(rid, "z", [7], True, self.finish_reason, None, None, 5, 0, self.kv_transfer_params)
            await self.queue.put(peer, RequestDeltas.of([delta]))
        else:
            params = msg.kv_transfer_params
            if isinstance(params, dict) and params.get("do_remote_prefill") is True:
                awaited = self._awaited[rid] = asyncio.get_running_loop().create_future()
                params = await awaited
            if params != self.expected_params:
                error = f"kv_transfer_params: expected {self.expected_params!r}, got {params!r}"
                await self.queue.put(peer, ErrorReply(rid, error, "invalid_request", "kv_transfer_params"))
                return
            first, *rest = decode_deltas(rid)
            await self.first_gate.wait()
            await self.queue.put(peer, RequestDeltas.of([first]))
            await self.gate.wait()
            for delta in rest:  # one frame per "step"
                await self.queue.put(peer, RequestDeltas.of([delta]))
        self._requests.pop(rid, None)
