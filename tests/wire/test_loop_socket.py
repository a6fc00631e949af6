"""`LoopSocket` over real ZMQ sockets: no lost wake-ups, no spinning, cancellation, loop changes."""

from __future__ import annotations

import asyncio
import select

import pytest
import zmq

from asyncpp.wire.loop_socket import LoopSocket

TIMEOUT_S = 10


@pytest.fixture
def addr(tmp_path):
    return lambda name: f"ipc://{tmp_path}/{name}"


def pair(addr, kinds=(zmq.PULL, zmq.PUSH)) -> tuple[LoopSocket, LoopSocket]:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(kinds[0]), ctx.socket(kinds[1])
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    a.bind(addr("s"))
    b.connect(addr("s"))
    return LoopSocket(a), LoopSocket(b)


async def test_a_waiting_receiver_gets_every_message_in_order(addr):
    pull, push = pair(addr)
    try:
        async def receive(n):
            return [await pull.recv() for _ in range(n)]

        task = asyncio.create_task(receive(300))
        for i in range(300):
            await push.send(b"%d" % i)
            if i % 7 == 0:
                await asyncio.sleep(0)  # let the receiver sleep on the socket now and then
        assert await asyncio.wait_for(task, TIMEOUT_S) == [b"%d" % i for i in range(300)]
    finally:
        pull.close()
        push.close()


async def test_sends_on_a_socket_do_not_lose_its_receivers_wake_up(addr):
    # Engine-like: the ROUTER's reader sleeps in recv while the same socket sends replies;
    # a send may take the FD signal of a request that arrived meanwhile.
    router, dealer = pair(addr, (zmq.ROUTER, zmq.DEALER))
    num = 400
    try:
        async def serve():
            for _ in range(num):
                peer, payload = await router.recv_multipart()
                await router.send_multipart([peer, b"re:" + payload])

        async def client():
            replies = []
            for i in range(num):
                await dealer.send(b"%d" % i)
                if i % 3 == 0:
                    replies.append(await dealer.recv())
            while len(replies) < num:
                replies.append(await dealer.recv())
            return replies

        server = asyncio.create_task(serve())
        replies = await asyncio.wait_for(client(), TIMEOUT_S)
        await asyncio.wait_for(server, TIMEOUT_S)
        assert replies == [b"re:%d" % i for i in range(num)]
    finally:
        router.close()
        dealer.close()


async def test_a_send_that_takes_a_sleeping_receivers_signal_wakes_it(addr):
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"d")
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    router.bind(addr("r"))
    dealer.connect(addr("r"))
    loop_router = LoopSocket(router)
    try:
        dealer.send(b"hello")
        assert await asyncio.wait_for(loop_router.recv_multipart(), TIMEOUT_S) == [b"d", b"hello"]
        sleeper = asyncio.create_task(loop_router.recv_multipart())
        await asyncio.sleep(0.05)  # it sleeps on the router's FD
        dealer.send(b"request")
        # Block the loop until the request has signalled the FD (an event, not a guess of how long):
        # the signal is unseen by the loop so far.
        assert select.select([router.getsockopt(zmq.FD)], [], [], TIMEOUT_S)[0], "the request never arrived"
        # A send on the same socket processes its pending commands: the signal is gone.
        await loop_router.send_multipart([b"d", b"reply"])
        assert await asyncio.wait_for(sleeper, 2) == [b"d", b"request"]
        assert dealer.recv() == b"reply"
    finally:
        loop_router.close()
        dealer.close()


async def test_a_cancelled_receive_leaves_the_socket_usable(addr):
    pull, push = pair(addr)
    try:
        task = asyncio.create_task(pull.recv())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await push.send(b"after")
        assert await asyncio.wait_for(pull.recv(), TIMEOUT_S) == b"after"
    finally:
        pull.close()
        push.close()


async def test_signals_nobody_waits_for_do_not_make_the_loop_spin(addr):
    pull, push = pair(addr)
    num_wake_ups = 0
    wake_ready = pull._wake_ready

    def counted_wake_ready() -> None:  # the reader callback the loop runs when the FD is readable
        nonlocal num_wake_ups
        num_wake_ups += 1
        wake_ready()

    pull._wake_ready = counted_wake_ready  # before the first receive registers it with the loop
    late = zmq.Context.instance().socket(zmq.PUSH)
    late.setsockopt(zmq.LINGER, 0)
    try:
        waiter = asyncio.create_task(pull.recv())
        await asyncio.sleep(0.05)  # it sleeps on the FD: the reader is registered
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await push.send(b"unread")
        await asyncio.sleep(0.05)
        late.connect(addr("s"))  # a new peer and its message: more signals, and nobody waits
        late.send(b"late")
        await asyncio.sleep(0.05)
        num_before = num_wake_ups
        for _ in range(200):  # 200 loop iterations: a readable FD nobody re-arms runs the reader in each
            await asyncio.sleep(0)
        assert num_wake_ups - num_before <= 2  # each signal was consumed, not polled in a loop
        received = {await asyncio.wait_for(pull.recv(), TIMEOUT_S) for _ in range(2)}
        assert received == {b"unread", b"late"}
    finally:
        late.close()
        pull.close()
        push.close()


def test_a_socket_moves_to_a_new_event_loop(addr):
    pull, push = pair(addr)
    try:
        for i in range(3):  # each asyncio.run is a fresh loop

            async def round_trip():
                task = asyncio.create_task(pull.recv())
                await asyncio.sleep(0.01)
                await push.send(b"%d" % i)
                return await asyncio.wait_for(task, TIMEOUT_S)

            assert asyncio.run(round_trip()) == b"%d" % i
    finally:
        pull.close()
        push.close()
