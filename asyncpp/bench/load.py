"""Drive one running engine: warm up, snapshot stats, send the requests, snapshot again.

Arrivals follow `vllm bench serve`: gaps drawn from an exponential
distribution of mean 1/rate (a Poisson process; rate inf = all at once), and
at most `max_concurrency` requests in flight (None = no limit). A request's
clock starts when it is actually sent, after waiting for a concurrency slot.

Bursts (`burst_size`, instead of a rate): the requests go `burst_size` at a
time, all at once (still at most `max_concurrency` in flight), and a burst
starts only when every request of the one before has finished, plus
`burst_gap_s` (time for the engine's background work, such as KV saves).
The gaps lie inside the measured duration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncpp.bench.cpu import CpuSnapshot
from asyncpp.bench.datasets import BenchRequest
from asyncpp.bench.metrics import RequestRecord, TokenTimer
from asyncpp.bench.openai_backend import OpenAIBackend
from asyncpp.bench.stage_kill import StageKill, kill_stage
from asyncpp.client import AsyncClient

NUM_WARMUP_REQUESTS = 2
WARMUP_OUTPUT_LEN = 8


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float  # first send to last finish
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    cpu_before: CpuSnapshot  # taken with stats_before / stats_after
    cpu_after: CpuSnapshot
    killed_at: float | None = None  # `kill`: when the stage was killed (monotonic s); None: it was not


def sampling_params(
    output_len: int, ignore_eos: bool, temperature: float, structured_outputs: dict[str, Any] | None = None
) -> dict[str, Any]:
    params = {"max_tokens": output_len, "temperature": temperature, "ignore_eos": ignore_eos}
    if structured_outputs is not None:
        params["structured_outputs"] = structured_outputs
    return params


def arrival_gaps_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


def burst_ranges(num_requests: int, burst_size: int) -> list[range]:
    """Request indices of each burst, in send order: [0, B), [B, 2B), ..., the last one shorter."""
    if burst_size < 1:
        raise ValueError(f"burst size must be >= 1, got {burst_size}")
    return [range(start, min(start + burst_size, num_requests)) for start in range(0, num_requests, burst_size)]


async def send_one(client: AsyncClient, request: BenchRequest, params: dict[str, Any]) -> RequestRecord:
    record = RequestRecord(expected_output_len=request.output_len, sent_at=time.monotonic())
    timer = TokenTimer(record)
    try:
        async for delta in client.generate(request.prompt, params):
            timer.on_delta(time.monotonic(), len(delta.token_ids), delta.num_prompt_tokens)
            if delta.finished:
                timer.on_finish(time.monotonic())
                if delta.finish_reason not in ("length", "stop"):
                    record.error = f"finished with {delta.finish_reason!r}"
    except Exception as e:  # noqa: BLE001 - one failed request is a figure, not a crash
        record.error = f"{type(e).__name__}: {e}"
    return record


async def warm_up(send: Callable[[BenchRequest, dict[str, Any]], Awaitable[RequestRecord]],
                  requests: Sequence[BenchRequest], temperature: float,
                  structured_outputs: dict[str, Any] | None = None) -> None:  # fmt: skip
    """As the measured requests are sent (a grammar's tokenizer is loaded at its first use)."""
    params = sampling_params(WARMUP_OUTPUT_LEN, True, temperature, structured_outputs)
    records = await asyncio.gather(*(send(r, params) for r in requests[:NUM_WARMUP_REQUESTS]))
    failed = [r.error for r in records if not r.is_ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


async def send_requests(
    send: Callable[[BenchRequest], Awaitable[RequestRecord]],
    requests: Sequence[BenchRequest],
    *,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    burst_size: int | None = None,
    burst_gap_s: float = 0.0,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
) -> list[RequestRecord]:
    """Every request through `send`, paced by rate or by bursts; records in request order."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(request: BenchRequest, burst: int | None) -> RequestRecord:
        if slots is None:
            record = await send(request)
        else:
            async with slots:
                record = await send(request)
        record.burst = burst
        on_done(record)
        return record

    if burst_size:
        records: list[RequestRecord] = []
        for burst, indices in enumerate(burst_ranges(len(requests), burst_size)):
            if burst > 0 and burst_gap_s > 0:
                await asyncio.sleep(burst_gap_s)
            records += await asyncio.gather(*(limited(requests[i], burst) for i in indices))
        return records
    tasks = []
    for request, gap_s in zip(requests, arrival_gaps_s(len(requests), request_rate, seed)):
        if gap_s > 0:
            await asyncio.sleep(gap_s)
        tasks.append(asyncio.create_task(limited(request, None)))
    return list(await asyncio.gather(*tasks))


async def _ended(killing: asyncio.Future | None) -> float | None:
    """The kill's time if it happened before the requests ended (else it is called off)."""
    if killing is None:
        return None
    if not killing.done():
        killing.cancel()
    await asyncio.gather(killing, return_exceptions=True)
    return killing.result() if not killing.cancelled() else None


async def run_load(
    address: str,
    requests: Sequence[BenchRequest],
    warmup_requests: Sequence[BenchRequest],
    *,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    ignore_eos: bool,
    temperature: float = 0.0,
    burst_size: int | None = None,
    burst_gap_s: float = 0.0,
    on_start: Callable[[], None] = lambda: None,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
    backend: OpenAIBackend | None = None,
    kill: StageKill | None = None,
    structured_outputs: dict[str, Any] | None = None,
) -> LoadResult:
    """Through the native client, or through `backend` (HTTP) when given. Engine stats come from
    `address` (the native client); with no address (an outside server) they are empty."""
    client = AsyncClient(address) if address else None

    async def stats() -> dict[str, Any]:
        return await client.stats() if client is not None else {}

    def send_with(request: BenchRequest, params: dict[str, Any]) -> Awaitable[RequestRecord]:
        return backend.send(request, params) if backend is not None else send_one(client, request, params)

    try:
        await warm_up(send_with, warmup_requests, temperature, structured_outputs)
        stats_before = await stats()
        cpu_before = CpuSnapshot.take(stats_before.get("stage_pids", []))

        async def send(request: BenchRequest) -> RequestRecord:
            return await send_with(request, sampling_params(request.output_len, ignore_eos, temperature, structured_outputs))

        on_start()
        started = time.monotonic()
        killing = asyncio.ensure_future(kill_stage(kill, stats)) if kill is not None else None
        try:
            records = await send_requests(
                send, requests, max_concurrency=max_concurrency, request_rate=request_rate, seed=seed,
                burst_size=burst_size, burst_gap_s=burst_gap_s, on_done=on_done,
            )
        finally:
            killed_at = await _ended(killing)
        finished = max((r.sent_at + r.e2e_s for r in records if r.e2e_s is not None), default=time.monotonic())
        stats_after = await stats()
        cpu_after = CpuSnapshot.take(stats_after.get("stage_pids", []))
        if stats_after.get("stage_pids") != stats_before.get("stage_pids"):  # restarted: other processes
            cpu_after = dataclasses.replace(cpu_after, stage_cpu_s=[None] * len(cpu_after.stage_cpu_s))
        return LoadResult(records, finished - started, stats_before, stats_after, cpu_before, cpu_after, killed_at)
    finally:
        if client is not None:
            client.close()
        if backend is not None:
            await backend.aclose()
