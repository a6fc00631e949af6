"""`ClientAccess`: who is let in and in which role; which addresses need a client secret; and the
same decisions made by the ZAP thread over real sockets (roles stamped on messages, refusals seen
by the refused client)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from asyncpp.client import AsyncClient, ClientRefusedError
from asyncpp.wire.client_auth import CLIENT, ENGINE, ClientAccess, is_loopback_address, new_secret
from asyncpp.wire.client_msgs import HealthRequest
from asyncpp.wire.queues import DealerQueue, RouterQueue


def test_the_client_role_takes_the_client_secret_or_anything_without_one():
    open_port = ClientAccess()
    assert open_port.allows(CLIENT, "none") and open_port.allows(CLIENT, "whatever")
    guarded = ClientAccess(client_secret="c-secret")
    assert guarded.allows(CLIENT, "c-secret")
    assert not guarded.allows(CLIENT, "c-secre") and not guarded.allows(CLIENT, "c-secret!") and not guarded.allows(CLIENT, "none")


def test_the_engine_role_takes_the_engine_secret_only_and_nobody_without_one():
    assert not ClientAccess().allows(ENGINE, "") and not ClientAccess().allows(ENGINE, "none")
    access = ClientAccess(client_secret="c-secret", engine_secret="e-secret")
    assert access.allows(ENGINE, "e-secret")
    assert not access.allows(ENGINE, "c-secret") and not access.allows(ENGINE, "e-secre")
    assert not access.allows("root", "e-secret") and not access.allows("", "c-secret")  # no other roles


def test_secrets_never_show_in_a_repr():
    access = ClientAccess("c-secret", "e-secret")
    assert "secret=set" in repr(access) and "c-secret" not in repr(access) and "e-secret" not in repr(access)
    assert repr(ClientAccess()) == "ClientAccess(client_secret=none, engine_secret=none)"
    first, second = new_secret(), new_secret()
    assert len(first) == 64 and first != second


@pytest.mark.parametrize(
    "address, loopback",
    [("tcp://127.0.0.1:5557", True), ("tcp://127.0.0.2:1", True), ("tcp://[::1]:5557", True), ("tcp://localhost:1", True),
     ("tcp://0.0.0.0:5557", False), ("tcp://*:5557", False), ("tcp://10.0.0.5:5557", False), ("tcp://[::]:1", False),
     ("tcp://eth0:5557", False), ("ipc:///tmp/x", True), ("inproc://x", True)],
)  # fmt: skip
def test_which_addresses_are_loopback(address, loopback):
    assert is_loopback_address(address) is loopback
    if loopback:
        ClientAccess().check_bind(address)
    else:
        with pytest.raises(ValueError, match=r"not on loopback: set server.client_secret"):
            ClientAccess().check_bind(address)
    ClientAccess(client_secret="s").check_bind(address)  # with a secret anywhere


async def test_roles_over_sockets():
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20, ClientAccess("c-secret", "e-secret"))
    peers = {
        (CLIENT, "c-secret"): CLIENT, (ENGINE, "e-secret"): ENGINE,
        (CLIENT, ""): None, (CLIENT, "e-secret"): None, (ENGINE, "c-secret"): None, ("admin", "e-secret"): None,
    }  # fmt: skip
    try:
        for (role, secret), expected in peers.items():
            dealer = DealerQueue(router.address, role=role, secret=secret)
            try:
                await dealer.put(HealthRequest(1))
                if expected is None:
                    reason = await asyncio.wait_for(dealer.refused(), 10.0)
                    assert reason in ("wrong token", "no token (handshake failed)")
                else:
                    _, got_role, msg = await asyncio.wait_for(router.get_with_role(), 10.0)
                    assert (got_role, msg) == (expected, HealthRequest(1))
            finally:
                dealer.close()
    finally:
        router.close()


async def test_a_refused_client_fails_its_calls_even_once_zmq_dropped_its_connection():
    """Refused, ZMQ drops the connection: a send then waits for one that never comes. Every call of
    the client must still end at once with `ClientRefusedError`, whenever it is made."""
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20, ClientAccess("c-secret"))
    stranger = AsyncClient(router.address, secret="wrong")
    try:
        await asyncio.sleep(1.0)  # the handshake fails meanwhile (no call has been made yet)
        for _ in range(2):
            with pytest.raises(ClientRefusedError, match="refused this client's credentials"):
                await asyncio.wait_for(stranger.health(timeout_s=60), 20.0)
            with pytest.raises(ClientRefusedError):
                await asyncio.wait_for(anext(aiter(stranger.generate("hi", {"max_tokens": 1}))), 20.0)
    finally:
        stranger.close()
        router.close()


async def test_a_call_refused_while_it_sends_leaves_no_error_unretrieved():
    """The refusal comes while the first call's request waits to be sent: it fails that call's reply
    future too, and the call raises from the send. That future must not be left behind, failed and
    never awaited (asyncio then logs "Future exception was never retrieved" whenever it is collected,
    in some later test or request)."""
    unhandled = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context["message"]))
    router = RouterQueue("tcp://127.0.0.1:0", 1 << 20, ClientAccess("c-secret"))
    stranger = AsyncClient(router.address, secret="wrong")
    refusals = 0
    try:
        await asyncio.sleep(1.0)  # the handshake fails meanwhile; the client reads the refusal on its first call
        for call in ("health", "stats"):  # names: a bound method would keep the client alive
            try:  # not pytest.raises: its traceback would keep the future alive past the collection below
                await asyncio.wait_for(getattr(stranger, call)(timeout_s=60), 20.0)
            except ClientRefusedError:
                refusals += 1
    finally:
        stranger.close()
        router.close()
    del stranger
    await asyncio.sleep(0.1)  # its cancelled tasks end, and with them their hold on the client
    gc.collect()
    assert refusals == 2 and unhandled == []
