"""`TransferLedger`: a stage's account of the transfers the engine waits for, so each ends in one report.

The engine frees a request's blocks only once every stage has reported its
load (`finished_recving`) or its send (`finished_sending`). A stage owes a
report for every load bound to it (`KVConnectorMetadata.loads`) and for
every request the engine holds for a send (`held_req_ids`); it owes nothing
else. The ledger sits between the connector and the engine (in
`KVConnectorWrapper`) and keeps that promise on every path:

* a report the stage does not owe (a duplicate, a request it never had) is
  dropped, so a request is reported at most once per transfer;
* a load that did not start, or that was aborted (`aborted_req_ids`, its
  deadline passed) is reported finished with all its blocks invalid (they
  are recomputed); a send that was aborted is reported finished and failed;
* saves that were bound but not run (the step failed before its forward
  ended) mark their request's send failed, whenever it is reported.
Invalid block ids are passed on only for loads still owed; quarantined and
released blocks always (they outlive the transfer).
Pure bookkeeping: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncpp.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput


class TransferLedger:
    def __init__(self) -> None:
        self._loads: dict[str, frozenset[int]] = {}  # request -> blocks its load fills, until reported
        self._sends: set[str] = set()  # held by the engine, until reported
        self._failed_sends: set[str] = set()  # saves skipped or aborted here: its send fails
        self._ended_loads: set[str] = set()  # ended here (not started, aborted): report them failed
        self._ended_sends: set[str] = set()

    @property
    def num_owed(self) -> int:
        return len(self._loads) + len(self._sends)

    def owes_load(self, request_id: str) -> bool:
        return request_id in self._loads

    def owes_send(self, request_id: str) -> bool:
        return request_id in self._sends

    def bind(self, metadata: KVConnectorMetadata) -> None:
        """A plan's metadata: the loads and sends this stage now owes a report for."""
        for load in metadata.loads:
            self._loads[load.request_id] = self._loads.get(load.request_id, frozenset()) | frozenset(load.block_ids)
        self._sends.update(metadata.held_req_ids)

    def end_loads(self, request_ids: Iterable[str]) -> None:
        """These loads will never complete here (not started, aborted): report them failed."""
        self._ended_loads.update(r for r in request_ids if r in self._loads)

    def end_sends(self, request_ids: Iterable[str]) -> None:
        """These held requests' sends were aborted here: report them finished and failed."""
        ended = {r for r in request_ids if r in self._sends}
        self._ended_sends |= ended
        self._failed_sends |= ended

    def fail_saves(self, request_ids: Iterable[str]) -> None:
        """Saves bound but not run: whatever these requests stored is incomplete."""
        self._failed_sends.update(request_ids)

    def settle(self, output: KVConnectorOutput | None, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
        """The connector's report of this step, restricted to what is owed, plus the ended transfers."""
        output = output or KVConnectorOutput()
        recving = (output.finished_recving & self._loads.keys()) | self._ended_loads
        invalid = {b for b in output.invalid_block_ids if any(b in blocks for blocks in self._loads.values())}
        for request_id in self._ended_loads:
            invalid |= self._loads[request_id]
        sending = (output.finished_sending & self._sends) | self._ended_sends
        failed = sending & (self._failed_sends | output.failed_sending)
        for request_id in recving:
            del self._loads[request_id]
        self._sends -= sending
        self._failed_sends -= sending
        # A finished request the engine does not hold will never be reported: forget its failures.
        self._failed_sends -= finished_req_ids - self._sends
        self._ended_loads.clear()
        self._ended_sends.clear()
        return KVConnectorOutput(
            frozenset(sending), frozenset(recving), frozenset(invalid), output.stats, frozenset(failed),
            output.quarantined_block_ids, output.released_block_ids,
        )  # fmt: skip
