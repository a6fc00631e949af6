"""`KVOutputAggregator`: merge the stages' connector outputs of each step into one (seeds 000, 001).

Every stage transfers its own layers, so a request has finished sending or
receiving only once every stage has said so, and the stages say so on
different steps. The aggregator keeps, per request, the set of stages
(`pp_rank`) that have reported it, across steps; a request appears in the
merged output exactly once, on the step its last stage's report arrives, and
is forgotten then.

* Idempotent: a stage that reports the same request twice counts once.
* Only what the engine awaits counts (`awaited_sending`, `awaited_recving`):
  a report for a request nobody waits for (a stale one, or an id reused
  after the engine forgot the old request) is dropped, never counted.
* A request fails to send if any stage reported it in `failed_sending`.
Blocks that failed to load on any stage, quarantined and released blocks
(counted: each stage's, as they come) and transfer counters are merged as
they come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncpp.kv_transfer.metadata import KVConnectorOutput, KVTransferStats


class KVOutputAggregator:
    def __init__(self, expected_count: int) -> None:
        if expected_count < 1:
            raise ValueError(f"expected_count must be >= 1, got {expected_count}")
        self.expected_count = expected_count  # distinct stages whose reports finish a request
        self._sending: dict[str, set[int]] = {}  # request -> stages that reported it
        self._recving: dict[str, set[int]] = {}
        self._failed_sending: set[str] = set()  # some stage failed its send

    def aggregate(
        self,
        outputs: Sequence[KVConnectorOutput | None],
        awaited_sending: Callable[[str], bool] = lambda request_id: True,
        awaited_recving: Callable[[str], bool] = lambda request_id: True,
    ) -> KVConnectorOutput:
        """One step's outputs, `outputs[pp_rank]` (None where a stage had nothing), merged."""
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        invalid_block_ids: set[int] = set()
        quarantined: list[int] = []
        released: list[int] = []
        stats = KVTransferStats()
        for pp_rank, output in enumerate(outputs):
            if output is None:
                continue
            for request_id in output.finished_sending:
                if awaited_sending(request_id):
                    if request_id in output.failed_sending:
                        self._failed_sending.add(request_id)
                    self._count(request_id, pp_rank, self._sending, finished_sending)
            for request_id in output.finished_recving:
                if awaited_recving(request_id):
                    self._count(request_id, pp_rank, self._recving, finished_recving)
            invalid_block_ids |= output.invalid_block_ids
            quarantined += output.quarantined_block_ids
            released += output.released_block_ids
            stats = stats + output.stats
        failed_sending = finished_sending & self._failed_sending
        self._failed_sending -= failed_sending
        return KVConnectorOutput(
            frozenset(finished_sending),
            frozenset(finished_recving),
            frozenset(invalid_block_ids),
            stats,
            frozenset(failed_sending),
            quarantined,
            released,
        )

    def reporters(self, request_id: str) -> tuple[frozenset[int], frozenset[int]]:
        """(stages that reported its send, stages that reported its load) so far."""
        return frozenset(self._sending.get(request_id, ())), frozenset(self._recving.get(request_id, ()))

    def forget(self, request_id: str) -> None:
        """The engine no longer waits for this request: drop whatever some stages reported."""
        self._sending.pop(request_id, None)
        self._recving.pop(request_id, None)
        self._failed_sending.discard(request_id)

    def forget_all(self) -> None:
        """The stages were restarted: the reports some sent will never be completed by the others."""
        self._sending.clear()
        self._recving.clear()
        self._failed_sending.clear()

    def num_pending(self) -> int:
        """Requests reported by some stages but not all yet."""
        return len(self._sending) + len(self._recving)

    def _count(self, request_id: str, pp_rank: int, reported: dict[str, set[int]], finished: set[str]) -> None:
        ranks = reported.setdefault(request_id, set())
        ranks.add(pp_rank)
        if len(ranks) >= self.expected_count:
            del reported[request_id]
            finished.add(request_id)
