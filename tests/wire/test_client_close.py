"""Closing an `AsyncClient` ends its open streams at once (they would otherwise wait forever)."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient, RequestFailedError
from asyncpp.wire.queues import RouterQueue


async def test_close_ends_open_streams():
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20)  # takes the request, never answers
    client = AsyncClient(router.address)
    try:
        stream = asyncio.create_task(anext(aiter(client.generate("hello", {"max_tokens": 4}))))
        await asyncio.wait_for(router.get(), 10.0)
        client.close()
        with pytest.raises(RequestFailedError, match="closed: the client was closed"):
            await asyncio.wait_for(stream, 5.0)
    finally:
        router.close()
