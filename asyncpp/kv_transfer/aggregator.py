"""`KVOutputAggregator`: merge the stages' connector outputs of each step into one (seeds 000, 001).

Every stage transfers its own layers, so a request has finished sending or
receiving only once every stage has said so, and the stages say so on
different steps. The aggregator keeps, per request, how many reports are
still missing (`expected_count`, one per stage unless the connector says
otherwise); the count survives across steps, and a request appears in the
merged output exactly once, on the step its last report arrives. Blocks that
failed to load on any stage and transfer counters are merged as they come.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncpp.kv_transfer.metadata import KVConnectorOutput, KVTransferStats


class KVOutputAggregator:
    def __init__(self, expected_count: int) -> None:
        if expected_count < 1:
            raise ValueError(f"expected_count must be >= 1, got {expected_count}")
        self.expected_count = expected_count
        self._remaining_sending: dict[str, int] = {}
        self._remaining_recving: dict[str, int] = {}

    def aggregate(self, outputs: Iterable[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One step's outputs (one per stage, None where a stage had nothing) merged."""
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        invalid_block_ids: set[int] = set()
        stats = KVTransferStats()
        for output in outputs:
            if output is None:
                continue
            self._count(output.finished_sending, self._remaining_sending, finished_sending)
            self._count(output.finished_recving, self._remaining_recving, finished_recving)
            invalid_block_ids |= output.invalid_block_ids
            stats = stats + output.stats
        return KVConnectorOutput(
            frozenset(finished_sending), frozenset(finished_recving), frozenset(invalid_block_ids), stats
        )

    def num_pending(self) -> int:
        """Requests reported by some stages but not all yet."""
        return len(self._remaining_sending) + len(self._remaining_recving)

    def _count(self, req_ids: frozenset[str], remaining: dict[str, int], finished: set[str]) -> None:
        for req_id in req_ids:
            left = remaining.get(req_id, self.expected_count) - 1
            if left > 0:
                remaining[req_id] = left
            else:
                remaining.pop(req_id, None)
                finished.add(req_id)
