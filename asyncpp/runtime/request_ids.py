"""`RequestIds`: request ids are scoped per client; the engine's own ids are unique inside it.

The rule, the same on every deployment (one engine, or engines behind the PD
router, which keys requests by (client, id) and makes engine ids of its own):
a client names its requests, and two clients may use the same id at once;
one client's id names one live request of its, so a second one while the
first is live is refused ("duplicate request id"), and only that client can
abort it. The engine knows each request by an id unique inside it, which
`assign` picks: the client's own when no live request of any client has it
and the engine holds none by it (a finished one still in a step in flight, or
whose blocks a remote engine still pulls), so that logs, traces and KV
connector params read as the client's; else `<id>@<n>`, the first free `n` of
a counter this port keeps. Everything going out to a client carries its own
id (`client_id`), and everything a client sends about a request (an abort, a
remote prefill done) is looked up by (client, id) (`engine_id`).

A request that carries `kv_transfer_params` keeps its id or is refused
(`keep`): in a disaggregated deployment other engines name it by that id (a
decode engine's `AwaitedPrefill` names the prefill engine's request, which the
router asked for under the same id), so a renamed one would never be found.
The router's ids carry 64 random bits of its own, so only a client that takes
one of them on purpose can make the router's request be refused.

An engine id stays reserved from `assign` until `release`, even once its client
is `detach`ed from it (an abort while the request is still being taken): the
client may then use its id again, under another engine id, at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable


class RequestIds:
    def __init__(self) -> None:
        self._engine_ids: dict[tuple[bytes, str], str] = {}  # live (client, its id) -> engine id
        self._clients: dict[str, tuple[bytes, str]] = {}  # reserved engine id -> (client, its id)
        self.derived: dict[str, str] = {}  # reserved engine id -> its client's id, where they differ (few)
        self._num_derived = itertools.count(1)

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._clients

    def engine_id(self, peer: bytes, request_id: str) -> str | None:
        """The engine id of this client's live request `request_id`, if it has one."""
        return self._engine_ids.get((peer, request_id))

    def client_id(self, engine_id: str) -> str:
        """The id the request's client knows it by (`engine_id` itself if no client has it)."""
        client = self._clients.get(engine_id)
        return engine_id if client is None else client[1]

    def assign(self, peer: bytes, request_id: str, is_held: Callable[[str], bool], keep: bool = False) -> str | None:
        """Reserve an engine id for the client's new request `request_id` (the caller refused a duplicate
        already): its own if free, else a derived one; None if it must `keep` its own and that is taken.
        `is_held(engine_id)`: whether the engine still holds a request by that id."""
        engine_id = request_id
        while engine_id in self._clients or is_held(engine_id):
            if keep:
                return None
            engine_id = f"{request_id}@{next(self._num_derived)}"
        self._engine_ids[(peer, request_id)] = engine_id
        self._clients[engine_id] = (peer, request_id)
        if engine_id != request_id:
            self.derived[engine_id] = request_id
        return engine_id

    def detach(self, engine_id: str) -> None:
        """Its client is done with it (the id is its own to use again); the engine id stays reserved."""
        client = self._clients.get(engine_id)
        if client is not None and self._engine_ids.get(client) == engine_id:
            del self._engine_ids[client]

    def release(self, engine_id: str) -> None:
        """The request is over: its engine id is free again (once the engine holds it no longer)."""
        self.detach(engine_id)
        self._clients.pop(engine_id, None)
        self.derived.pop(engine_id, None)
