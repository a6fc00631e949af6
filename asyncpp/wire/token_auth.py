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

The same ZAP thread checks the engines' client ports (`require_plain`, used
by `wire.client_auth`): there a function per socket decides which
username/password pairs may in, and ZMQ stamps the username on every message
that peer sends, which is how the port knows each peer's role.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

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

# The monitor events of a refused handshake, on either side.
REFUSAL_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_lock = threading.Lock()
_monitors = itertools.count()
_auth: "_Authenticator | None" = None
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


def monitor_address() -> str:
    """A monitor endpoint of its own: pyzmq's default is named after the socket's file descriptor,
    which a later socket reuses while the old monitor may still be connected (its events then never
    reach the new one's reader)."""
    return f"inproc://asyncpp-monitor-{next(_monitors)}"


def refusal_reason(event: int) -> str:
    return _REFUSALS.get(event, f"event {event}")


def require_plain(sock: zmq.Socket, domain: str, check: Callable[[str, str], bool], address: str) -> None:
    """Before bind: `sock` serves only PLAIN peers for which `check(username, password)` is true;
    each of their messages carries the username as its "User-Id" (what role they hold)."""
    with _lock:
        auth = _started(sock.context)
        auth.checks[domain] = check
    sock.plain_server = True
    sock.zap_domain = domain.encode()
    _watcher_for(sock.context).watch(sock, address)


def forget_plain(domain: str) -> None:
    """The socket of `domain` is closed: drop its check."""
    with _lock:
        if _auth is not None:
            _auth.checks.pop(domain, None)


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, which also asks a function per domain whether a PLAIN peer may in."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(ctx)
        self.checks: dict[str, Callable[[str, str], bool]] = {}

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        check = self.checks.get(domain)
        if check is None:
            return super()._authenticate_plain(domain, username, password)
        try:
            return (True, b"OK") if check(username, password) else (False, b"Invalid credentials")
        except Exception:  # noqa: BLE001 - a check that fails refuses; the ZAP thread lives on
            return False, b"Invalid credentials"


def _started(ctx: zmq.Context) -> _Authenticator:
    global _auth
    if _auth is None:
        _auth = _Authenticator(ctx)
        _auth.start()
    return _auth


def _ensure_auth(ctx: zmq.Context, token: str) -> None:
    with _lock:
        # One run per process: its token is the only one accepted.
        _started(ctx).configure_plain(domain=DOMAIN.decode(), passwords={USER: token})


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
        monitor = sock.get_monitor_socket(REFUSAL_EVENTS, monitor_address())
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
                reason = refusal_reason(event["event"])
                self._log.warning("control_connection_refused", address=addresses.get(sock), reason=reason)
