"""Who may talk to an engine's client port, and in which role (ZMQ PLAIN through `token_auth`'s ZAP thread).

Two roles, checked before a peer's first frame reaches the engine:
* `client` (generate, abort, health, stats): with `server.client_secret` set,
  only peers that present it; without one, any local peer (a port without a
  secret binds only to loopback: `ClientAccess.check_bind`), as the HTTP port
  without an API key;
* `engine` (KV handshakes, adding a remote engine, and everything a client
  may): only peers that present the deployment's engine secret
  (`server.engine_secret`, or one the launcher makes for its own router and
  engines). Without it no peer holds the role.
ZMQ stamps the username a peer authenticated with on each of its messages
("User-Id"); `RouterQueue` hands it to the port with the message. PLAIN
sends the secret in the clear on connect: it keeps other users of the
machine or network off the port; it does not hide the traffic.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from asyncpp.config import is_loopback

CLIENT = "client"
ENGINE = "engine"
_domains = itertools.count()


def new_secret() -> str:
    """A deployment secret: 256 random bits."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class ClientAccess:
    """What an engine's (or router's) client port lets in: `client_secret` "" = any local client;
    `engine_secret` "" = nobody holds the engine role."""

    client_secret: str = ""
    engine_secret: str = ""

    def __repr__(self) -> str:  # never in a log line
        return f"ClientAccess(client_secret={'set' if self.client_secret else 'none'}, engine_secret={'set' if self.engine_secret else 'none'})"

    def allows(self, username: str, password: str) -> bool:
        """Whether a peer presenting these credentials is let in (in the role `username`)."""
        if username == ENGINE:
            return bool(self.engine_secret) and hmac.compare_digest(password.encode(), self.engine_secret.encode())
        if username == CLIENT:
            return not self.client_secret or hmac.compare_digest(password.encode(), self.client_secret.encode())
        return False

    def check_bind(self, address: str) -> None:
        """`ValueError` for a port off loopback that any client could use."""
        if not self.client_secret and not is_loopback_address(address):
            raise ValueError(
                f"the client port {address} is not on loopback: set server.client_secret so that only "
                "clients that present it are served"
            )

    @staticmethod
    def new_domain() -> str:
        """A ZAP domain of its own for one bound socket (several ports may live in one process)."""
        return f"asyncpp-clients-{next(_domains)}"


def is_loopback_address(address: str) -> bool:
    """For "tcp://HOST:PORT" (and "ipc://", "inproc://", which stay on the machine); "*", an interface or
    a host name are not known to be loopback."""
    parts = urlsplit(address)
    return parts.scheme != "tcp" or is_loopback(parts.hostname or "")
