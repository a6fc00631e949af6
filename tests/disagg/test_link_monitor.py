"""The router's health monitor of an engine ends when cancelled, even when the cancel meets a check's timeout."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.disagg.link import EngineLink


async def test_a_cancel_that_meets_a_checks_timeout_still_ends_the_monitor():
    """Python 3.11's `wait_for` turns a cancel that arrives as its timeout fires into TimeoutError, which
    `check` reports as a dead engine: the monitor must still end (the router's close awaits it; a PD
    test's teardown hung there once)."""
    link = EngineLink("decode", "tcp://127.0.0.1:9", health_interval_s=0.01)
    checking = asyncio.Event()

    async def check_that_loses_the_cancel() -> str | None:
        checking.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "no health reply within 1 s"  # what the lost cancellation looks like to the monitor
        return None

    link.check = check_that_loses_the_cancel
    task = asyncio.create_task(link.monitor())
    try:
        await asyncio.wait_for(checking.wait(), 5)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, "the monitor went on after its cancel"
        with pytest.raises(asyncio.CancelledError):
            task.result()
        assert link.dead_reason is None  # and took no decision from the interrupted check
    finally:
        task.cancel()
        link.close()
