"""Runtime fixtures: one shared pp=2 engine for tests that leave it as they found it, and polling helpers.

Launching an engine costs ~10 s on the shared 2-core machine, so tests that
only need a healthy engine (aborts, bad frames, concurrency) share one; each
of them must finish or abort everything it submits. Tests that kill or stop
the engine launch their own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from asyncpp.client import AsyncClient
from tests.runtime.harness import launched, tiny_sections


@pytest.fixture(scope="session")
def shared_pp2_engine(tmp_path_factory, tiny_hf_dir):
    """A pp=2 engine on the tiny model (layers 2 + 2), up for the whole session."""
    with launched(tmp_path_factory.mktemp("shared-pp2"), tiny_sections(tiny_hf_dir, 2, (2, 2))) as engine:
        yield engine
    assert engine.proc.returncode == 0, "".join(engine.output[-40:])


async def collect(client: AsyncClient, prompt, params) -> tuple[list[int], str, str | None]:
    """(token ids, text, finish reason) of one whole request."""
    tokens, text, reason = [], "", None
    async for delta in client.generate(prompt, params):
        tokens += delta.token_ids
        text += delta.text
        reason = delta.finish_reason
    return tokens, text, reason


async def collect_all(address: str, prompts, params) -> tuple[list[tuple[list[int], str, str | None]], dict]:
    """Every prompt at once through one client: their `collect` results, then the engine's stats."""
    client = AsyncClient(address)
    try:
        results = await asyncio.gather(*(collect(client, p, params) for p in prompts))
        return results, await client.stats()
    finally:
        client.close()


async def poll_until(
    probe: Callable[[], Awaitable[Any]], is_done: Callable[[Any], bool], timeout_s: float, interval_s: float = 0.05
) -> Any:
    """Await `probe()` until `is_done(value)`; fail with the last value once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if is_done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s; last value: {value!r}")
        await asyncio.sleep(interval_s)


def wait_until(is_done: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Synchronous poll; returns the seconds it took."""
    t0 = time.monotonic()
    while not is_done():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - t0


def is_idle(stats: dict) -> bool:
    return (
        stats["num_running"] == 0
        and stats["num_waiting"] == 0
        and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    )


def log_events(log_file: Path, **match: Any) -> list[str]:
    """Event names of the JSON log lines whose fields include all of `match` (e.g. request_id=...)."""
    events = []
    # The shared engine logs every step at debug level: skip lines that cannot match before parsing.
    needles = [json.dumps(v) for v in match.values() if isinstance(v, str)]
    for line in log_file.read_text().splitlines():
        if not all(n in line for n in needles):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if all(record.get(k) == v for k, v in match.items()):
            events.append(record["event"])
    return events


async def wait_for_event(log_file: Path, event: str, timeout_s: float, **match: Any) -> list[str]:
    """Poll the engine's log until `event` shows up for `match`; returns all of match's events so far."""

    async def probe() -> list[str]:
        return log_events(log_file, **match)

    return await poll_until(probe, lambda events: event in events, timeout_s)
