"""Request pacing of the load generator with a fake engine: bursts one after the other, concurrency caps."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from asyncpp.bench.datasets import BenchRequest
from asyncpp.bench.load import burst_ranges, send_requests
from asyncpp.bench.metrics import RequestRecord

SERVICE_S = 0.02


class FakeEngine:
    """Serves each request in SERVICE_S; remembers when each started and ended and the peak in flight."""

    def __init__(self) -> None:
        self.spans: dict[str, tuple[float, float]] = {}
        self.in_flight = 0
        self.max_in_flight = 0

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord(expected_output_len=request.output_len, sent_at=time.monotonic())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(SERVICE_S)
        self.in_flight -= 1
        record.ttft_s = record.e2e_s = time.monotonic() - record.sent_at
        self.spans[request.prompt] = (record.sent_at, record.sent_at + record.e2e_s)
        return record


def requests(n: int) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", i + 1) for i in range(n)]


def test_burst_ranges_cover_every_request_in_order():
    assert burst_ranges(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert burst_ranges(0, 3) == [] and burst_ranges(2, 5) == [range(0, 2)]
    with pytest.raises(ValueError):
        burst_ranges(4, 0)


async def test_a_burst_starts_after_the_previous_one_finished_and_the_gap():
    engine, gap_s, done = FakeEngine(), 0.05, []
    records = await send_requests(
        engine.send, requests(7), max_concurrency=None, request_rate=math.inf, seed=0,
        burst_size=3, burst_gap_s=gap_s, on_done=done.append,
    )
    assert [r.expected_output_len for r in records] == list(range(1, 8))  # request order
    assert [r.burst for r in records] == [0, 0, 0, 1, 1, 1, 2]
    assert len(done) == 7 and engine.max_in_flight == 3
    bursts = [[engine.spans[f"r{i}"] for i in indices] for indices in burst_ranges(7, 3)]
    for earlier, later in zip(bursts, bursts[1:]):  # sleeps never end early: a lower bound only
        assert min(start for start, _ in later) >= max(end for _, end in earlier) + gap_s * 0.9
    for burst in bursts:  # all of a burst at once: each starts before any of them ends (no time limit)
        assert max(start for start, _ in burst) < min(end for _, end in burst)


async def test_concurrency_limit_applies_inside_a_burst():
    engine = FakeEngine()
    records = await send_requests(
        engine.send, requests(8), max_concurrency=2, request_rate=math.inf, seed=0, burst_size=4, burst_gap_s=0.0
    )
    assert engine.max_in_flight == 2 and [r.burst for r in records] == [0] * 4 + [1] * 4
    first_of_second = min(engine.spans[f"r{i}"][0] for i in range(4, 8))
    assert first_of_second >= max(engine.spans[f"r{i}"][1] for i in range(4))


async def test_without_bursts_all_go_at_once_and_carry_no_burst():
    engine = FakeEngine()
    records = await send_requests(engine.send, requests(6), max_concurrency=None, request_rate=math.inf, seed=0)
    assert engine.max_in_flight == 6 and all(r.burst is None for r in records)
    assert records[0].to_dict()["burst"] is None and RequestRecord(burst=2).to_dict()["burst"] == 2
