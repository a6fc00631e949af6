"""Interval helpers on half-open [start, end) integer µs intervals.

`union_length` is the busy time of a set of possibly overlapping slices.
`assign_lanes` puts intervals on the fewest lanes such that intervals on one
lane never overlap (touching ends are allowed), which is what a trace viewer
needs to draw them as a flat row of slices.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def union_length(intervals: Sequence[tuple[int, int]]) -> int:
    """Total length covered by the union of the intervals."""
    total = 0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def assign_lanes(intervals: Sequence[tuple[int, int]]) -> list[int]:
    """Lane index per interval (same order as given); greedy by start time, lowest free lane first.

    Greedy interval partitioning is optimal: it uses as many lanes as the
    maximum number of intervals in flight at one instant.
    """
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    lanes = [0] * len(intervals)
    busy: list[tuple[int, int]] = []  # heap of (end, lane) for lanes in use
    free: list[int] = []  # heap of released lane indices
    num_lanes = 0
    for i in order:
        start, end = intervals[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane, num_lanes = num_lanes, num_lanes + 1
        lanes[i] = lane
        heapq.heappush(busy, (end, lane))
    return lanes
