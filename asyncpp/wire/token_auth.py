"""Per-run token on control-plane sockets that cross hosts (ZMQ PLAIN + a ZAP handler), refusals logged.

A bound socket given a token accepts only peers that present it (ZMQ's PLAIN
mechanism, user `asyncpp`, password = the run's token); a connecting socket
given the token presents it. The check runs in pyzmq's ZAP thread, one per
process, before any frame reaches our code, so a refused peer never delivers
a message and the serving loop never sees it. Every refused handshake (no
token: a mechanism mismatch; a wrong one: denied by ZAP) is logged as
`control_connection_refused` by a watcher thread reading the sockets'
monitors. The token reaches the stages through the placement (Ray's actor
arguments). PLAIN sends it unencrypted on connect: this keeps strangers on
the network from driving a stage, it does not hide the traffic.
"""

from __future__ import annotations

import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from asyncpp.logging import get_logger

USER = "asyncpp"
DOMAIN = b"asyncpp"
_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "no token (another security mechanism)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "wrong token",
    # What a peer without a token sometimes yields instead, depending on who speaks first.
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no token (handshake failed)",
}

_lock = threading.Lock()
_auth: ThreadAuthenticator | None = None
_watcher: "_RefusalWatcher | None" = None


def secure_socket(sock: zmq.Socket, token: str, bind: bool, address: str) -> None:
    """Before bind/connect: make `sock` require (bind) or present (connect) `token`."""
    if not bind:
        sock.plain_username = USER.encode()
        sock.plain_password = token.encode()
        return
    _ensure_auth(sock.context, token)
    sock.plain_server = True
    sock.zap_domain = DOMAIN
    _watcher_for(sock.context).watch(sock, address)


def _ensure_auth(ctx: zmq.Context, token: str) -> None:
    global _auth
    with _lock:
        if _auth is None:
            _auth = ThreadAuthenticator(ctx)
            _auth.start()
        # One run per process: its token is the only one accepted.
        _auth.configure_plain(domain=DOMAIN.decode(), passwords={USER: token})


def _watcher_for(ctx: zmq.Context) -> "_RefusalWatcher":
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = _RefusalWatcher(ctx)
        return _watcher


class _RefusalWatcher:
    """One daemon thread logging every refused handshake on the watched sockets."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._log = get_logger(role="auth")
        self._pending: list[tuple[zmq.Socket, str]] = []
        self._wake_addr = f"inproc://asyncpp-auth-wake-{id(self)}"
        self._wake_out = ctx.socket(zmq.PAIR)
        self._wake_out.bind(self._wake_addr)
        self._wake_in = ctx.socket(zmq.PAIR)
        self._wake_in.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        threading.Thread(target=self._run, name="asyncpp-auth-watch", daemon=True).start()

    def watch(self, sock: zmq.Socket, address: str) -> None:
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        with self._wake_lock:
            self._pending.append((monitor, address))
            self._wake_out.send(b"")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        addresses: dict[zmq.Socket, str] = {}
        while True:
            for sock, _ in poller.poll():
                if sock is self._wake_in:
                    self._wake_in.recv()
                    with self._wake_lock:
                        for monitor, address in self._pending:
                            addresses[monitor] = address
                            poller.register(monitor, zmq.POLLIN)
                        self._pending.clear()
                    continue
                try:
                    event = recv_monitor_message(sock)
                except zmq.ZMQError:  # the watched socket closed
                    poller.unregister(sock)
                    continue
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    poller.unregister(sock)
                    continue
                reason = _REFUSALS.get(event["event"], f"event {event['event']}")
                self._log.warning("control_connection_refused", address=addresses.get(sock), reason=reason)
