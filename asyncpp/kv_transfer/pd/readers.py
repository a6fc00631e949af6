"""`HandoutReaders`: a producer stage's count of who has read each handout, and the notifications that say so.

Every consumer stage that reads a producer stage's layers of a handed-out
prompt notifies it once done: "request|nonce|consumer pp_rank|readers"
(`notification`), where `readers` is how many consumer stages read this
producer stage's layers (so producers need not know the consumer's layout)
and `nonce` is the one of the signed params it read under
(`params.RemotePrefill.nonce`). A held request (the engine keeps its blocks)
is done once that many consumer stages have notified under the nonce of its
handout, or under "" (a consumer stage that read nothing and never learned
the nonce: an early pull that ended before any ready notice). Notifications
under any other nonce (replayed params of a reused request id) never count;
like those for requests never held here, they are dropped after
`pull_timeout_s`. Notifications may arrive before the hold does.
"""

from __future__ import annotations

from asyncpp.logging import get_logger


def notification(remote_request_id: str, nonce: str, pp_rank: int, num_readers: int) -> bytes:
    return f"{remote_request_id}|{nonce}|{pp_rank}|{num_readers}".encode()


def parse_notification(msg: bytes) -> tuple[str, str, int, int] | None:
    try:
        request_id, nonce, pp_rank, num_readers = msg.decode().rsplit("|", 3)
        return request_id, nonce, int(pp_rank), int(num_readers)
    except ValueError:
        return None


class HandoutReaders:
    def __init__(self, pull_timeout_s: float, pp_rank: int) -> None:
        self.pull_timeout_s = pull_timeout_s
        self._nonces: dict[str, str] = {}  # held request -> the nonce of its handout
        self._readers: dict[tuple[str, str], dict[int, int]] = {}  # (request, nonce) -> consumer pp_rank -> readers
        self._first_at: dict[tuple[str, str], float] = {}  # when its first notification came
        self.log = get_logger(role="stage", pp_rank=pp_rank, connector="pd", kv_role="producer")

    def hold(self, request_ids: list[str], nonces: dict[str, str]) -> None:
        """The engine holds these requests' blocks for the handouts of these nonces."""
        for request_id in request_ids:
            self._nonces[request_id] = nonces.get(request_id, "")

    def on_notification(self, request_id: str, nonce: str, pp_rank: int, num_readers: int, now: float) -> None:
        self._readers.setdefault((request_id, nonce), {})[pp_rank] = num_readers
        self._first_at.setdefault((request_id, nonce), now)

    def take_done(self, now: float) -> frozenset[str]:
        """Held requests every reader of their handout has notified (no longer held); drops the
        notifications of no held handout after `pull_timeout_s`."""
        done = []
        for request_id, nonce in self._nonces.items():
            keys = [(request_id, nonce), (request_id, "")]
            readers = {rank: n for key in keys for rank, n in self._readers.get(key, {}).items()}
            if readers and len(readers) >= max(readers.values()):
                done.append(request_id)
        for request_id in done:
            self.forget(request_id)
        for key, at in list(self._first_at.items()):
            if not self._is_held(key) and now - at > self.pull_timeout_s:
                # Never held here (finished elsewhere, forged), or readers of another handout of that
                # request id (replayed params): they never count for this one. Drop them.
                self.log.warning("kv_notification_of_no_handout", request_id=key[0], nonce=key[1])
                self._readers.pop(key, None)
                del self._first_at[key]
        return frozenset(done)

    def forget(self, request_id: str) -> None:
        """No longer held (done, or aborted): its handout's notifications go too."""
        for key in ((request_id, self._nonces.pop(request_id, None)), (request_id, "")):
            self._readers.pop(key, None)
            self._first_at.pop(key, None)

    def _is_held(self, key: tuple[str, str]) -> bool:
        request_id, nonce = key
        return request_id in self._nonces and nonce in ("", self._nonces[request_id])
