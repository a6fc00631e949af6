"""`Quarantine`: reads into a stage's KV cache that NIXL could not stop, and the blocks they may write.

NIXL cannot abort a running read (`transport.nixl_agent`): `release` waits up
to its timeout, then raises `TimeoutError` and keeps the handle, and bytes
may still land in the local blocks. Such blocks must not be reused: the
quarantine reports them (`take`: quarantined since the last report), the
engine keeps them out of its free pool (`BlockManager.quarantine`), and
every step `retry` looks again without waiting; a read that has ended is
released and its blocks reported released. Counted: a block under two
unstopped reads is reported (and released) twice.
"""

from __future__ import annotations

from asyncpp.logging import get_logger
from asyncpp.transport.nixl_agent import NixlTransport, TransferHandle, TransferState


class Quarantine:
    def __init__(self, pp_rank: int) -> None:
        self._unstopped: list[tuple[TransferHandle, list[int]]] = []  # (read, local blocks it may write)
        self._quarantined: list[int] = []  # since the last report
        self._released: list[int] = []
        self.log = get_logger(role="stage", pp_rank=pp_rank, connector="pd")

    def release(self, transport: NixlTransport, handle: TransferHandle, block_ids: list[int], request_id: str) -> bool:
        """Free a read's handle; False if NIXL cannot stop it (its blocks are quarantined)."""
        try:
            transport.release(handle)
            return True
        except TimeoutError as e:
            self.log.error("kv_pull_not_stopped", request_id=request_id, num_blocks=len(block_ids), error=str(e))
            self._unstopped.append((handle, list(block_ids)))
            self._quarantined += block_ids
            return False

    def retry(self, transport: NixlTransport) -> None:
        """Reads that have ended by now give their blocks back (never waits: the stage loop goes on)."""
        for entry in list(self._unstopped):
            handle, block_ids = entry
            if transport.poll(handle) is TransferState.RUNNING:
                continue
            try:
                transport.release(handle)
            except TimeoutError:
                continue
            self._unstopped.remove(entry)
            self._released += block_ids
            self.log.info("kv_pull_stopped_late", num_blocks=len(block_ids))

    def take(self) -> tuple[list[int], list[int]]:
        """(blocks quarantined, blocks released) since the last call."""
        quarantined, released = self._quarantined, self._released
        self._quarantined, self._released = [], []
        return quarantined, released
