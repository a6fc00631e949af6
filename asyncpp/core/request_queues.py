"""`RequestQueues`: the scheduler's waiting and running queues, both in priority order.

Priority is arrival order: the order requests were `add`ed (a counter, not
`arrival_time`, so ties and clock steps cannot reorder them). Invariants:
* `running` holds RUNNING requests and `waiting` WAITING / PREEMPTED ones,
  each sorted oldest first; a request is in at most one of them.
* New arrivals are younger than everything queued, so `add` appends; a
  preempted request is older than every never-admitted one, so re-inserting
  it scans only the preempted requests at the head of `waiting`.
Requests are compared by identity (`Request` is a dataclass: `==` compares
every field).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from asyncpp.core.request import Request


class RequestQueues:
    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrival_seq: dict[str, int] = {}  # lower is older
        self._seq_counter = itertools.count()

    def priority(self, request: Request) -> int:
        return self._arrival_seq[request.request_id]

    def add(self, request: Request) -> None:
        self._arrival_seq[request.request_id] = next(self._seq_counter)
        self.waiting.append(request)

    def forget(self, request_id: str) -> None:
        """Drop the priority of a request that is in neither queue any more."""
        self._arrival_seq.pop(request_id, None)

    def admit(self, request: Request) -> None:
        """Move a waiting request into `running`, in priority order."""
        self.take_waiting(request)
        bisect.insort(self.running, request, key=self.priority)

    def take_waiting(self, request: Request) -> None:
        """Take a request out of `waiting` (it leaves to be admitted, or to wait for its KV)."""
        if self.waiting and self.waiting[0] is request:  # the usual case
            self.waiting.popleft()
        elif not _remove(self.waiting, request):
            raise ValueError(f"request {request.request_id!r} is not waiting")

    def requeue(self, request: Request) -> None:
        """Move a running request back to `waiting`, ahead of everyone younger."""
        _remove(self.running, request)
        seq = self.priority(request)
        index = next((i for i, r in enumerate(self.waiting) if self.priority(r) > seq), len(self.waiting))
        self.waiting.insert(index, request)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (no-op if none)."""
        _remove(self.running, request) or _remove(self.waiting, request)

    def youngest_idle_running(self) -> Request | None:
        """The lowest-priority running request not in flight (scheduled ones are in flight at once)."""
        return next((r for r in reversed(self.running) if not r.is_in_flight), None)


def _remove(queue: list[Request] | deque[Request], request: Request) -> bool:
    for index, queued in enumerate(queue):
        if queued is request:
            del queue[index]
            return True
    return False
