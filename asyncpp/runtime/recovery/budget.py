"""`RestartBudget`: at most `max_restarts` stage restarts within any `window_s` seconds."""

from __future__ import annotations

import collections


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()

    def take(self, now: float) -> bool:
        """One more restart at `now` (monotonic seconds), if the last `window_s` leave room for it."""
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True
