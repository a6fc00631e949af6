"""Drive one running engine: warm up, snapshot stats, send the requests, snapshot again.

Arrivals follow `vllm bench serve`: gaps drawn from an exponential
distribution of mean 1/rate (a Poisson process; rate inf = all at once), and
at most `max_concurrency` requests in flight (None = no limit). A request's
clock starts when it is actually sent, after waiting for a concurrency slot.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncpp.bench.cpu import CpuSnapshot
from asyncpp.bench.datasets import BenchRequest
from asyncpp.bench.metrics import RequestRecord, TokenTimer
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


def sampling_params(output_len: int, ignore_eos: bool, temperature: float) -> dict[str, Any]:
    return {"max_tokens": output_len, "temperature": temperature, "ignore_eos": ignore_eos}


def arrival_gaps_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


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


async def warm_up(client: AsyncClient, requests: Sequence[BenchRequest], temperature: float) -> None:
    params = sampling_params(WARMUP_OUTPUT_LEN, True, temperature)
    records = await asyncio.gather(*(send_one(client, r, params) for r in requests[:NUM_WARMUP_REQUESTS]))
    failed = [r.error for r in records if not r.is_ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


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
    on_start: Callable[[], None] = lambda: None,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
) -> LoadResult:
    client = AsyncClient(address)
    try:
        await warm_up(client, warmup_requests, temperature)
        stats_before = await client.stats()
        cpu_before = CpuSnapshot.take(stats_before.get("stage_pids", []))
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(request: BenchRequest) -> RequestRecord:
            params = sampling_params(request.output_len, ignore_eos, temperature)
            if slots is None:
                record = await send_one(client, request, params)
            else:
                async with slots:
                    record = await send_one(client, request, params)
            on_done(record)
            return record

        on_start()
        started = time.monotonic()
        tasks = []
        for request, gap_s in zip(requests, arrival_gaps_s(len(requests), request_rate, seed)):
            if gap_s > 0:
                await asyncio.sleep(gap_s)
            tasks.append(asyncio.create_task(limited(request)))
        records = list(await asyncio.gather(*tasks))
        finished = max((r.sent_at + r.e2e_s for r in records if r.e2e_s is not None), default=time.monotonic())
        stats_after = await client.stats()
        cpu_after = CpuSnapshot.take(stats_after.get("stage_pids", []))
        return LoadResult(records, finished - started, stats_before, stats_after, cpu_before, cpu_after)
    finally:
        client.close()
