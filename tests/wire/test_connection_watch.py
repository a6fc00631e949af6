"""Which client sockets watch their connection, and that watching ones close cleanly.

Only a socket made with `watch_connection=True` (the HTTP server's one client) has its monitor
report connections made and lost: with those events on every client socket, a process that made
and closed many (the PD router tests, in process) stopped completing ZMQ handshakes, and every
later test timed out. A plain socket reports a refusal only. A watching socket closed while
connected (its monitor detached first) leaves later connections working.
"""

from __future__ import annotations

import asyncio

from asyncpp.wire.client_msgs import HealthReply, HealthRequest
from asyncpp.wire.queues import CONNECTED, DealerQueue, RouterQueue


async def answer_health(router: RouterQueue) -> None:
    while True:
        peer, msg = await router.get()
        await router.put(peer, HealthReply(msg.nonce, True))


async def round_trip(router: RouterQueue, watch: bool, nonce: int) -> None:
    client = DealerQueue(router.address, watch_connection=watch)
    try:
        if watch:
            assert await asyncio.wait_for(client.next_event(), 5.0) == (CONNECTED, "")
        await client.put(HealthRequest(nonce))
        assert await asyncio.wait_for(client.get(), 5.0) == HealthReply(nonce, True)
    finally:
        client.close()  # connected: its disconnect event is on the way as it closes


def test_watching_sockets_closed_while_connected_leave_later_connections_working():
    async def main() -> None:
        router = RouterQueue("tcp://127.0.0.1:0", 1 << 20)
        server = asyncio.create_task(answer_health(router))
        try:
            for nonce in range(40):
                await round_trip(router, watch=True, nonce=nonce)
            await round_trip(router, watch=False, nonce=1000)  # a plain client afterwards still gets its reply
        finally:
            server.cancel()
            router.close()

    asyncio.run(main())


def test_a_plain_socket_does_not_watch_its_connection():
    async def main() -> None:
        router = RouterQueue("tcp://127.0.0.1:0", 1 << 20)
        server = asyncio.create_task(answer_health(router))
        try:
            await round_trip(router, watch=False, nonce=1)
            plain = DealerQueue(router.address)
            try:
                await plain.put(HealthRequest(2))
                await asyncio.wait_for(plain.get(), 5.0)
                event = asyncio.ensure_future(plain.next_event())
                done, _ = await asyncio.wait([event], timeout=0.3)
                assert not done  # connected, yet no event: only a refusal would be one
                event.cancel()
            finally:
                plain.close()
        finally:
            server.cancel()
            router.close()

    asyncio.run(main())
