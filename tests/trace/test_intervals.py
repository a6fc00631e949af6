"""Interval union and lane assignment, checked against brute force on random intervals."""

from __future__ import annotations

import random

from asyncpp.trace.intervals import assign_lanes, union_length


def test_union_length_merges_overlaps_and_touching():
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 15), (20, 30), (30, 35), (21, 22)]) == 15 + 15


def test_union_length_matches_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        intervals = [(a, a + rng.randint(0, 20)) for a in (rng.randint(0, 100) for _ in range(rng.randint(1, 12)))]
        covered = {t for s, e in intervals for t in range(s, e)}
        assert union_length(intervals) == len(covered)


def test_lanes_never_overlap_and_use_max_concurrency():
    rng = random.Random(1)
    for _ in range(50):
        intervals = [(a, a + rng.randint(1, 30)) for a in (rng.randint(0, 100) for _ in range(rng.randint(1, 15)))]
        lanes = assign_lanes(intervals)
        for i, (s1, e1) in enumerate(intervals):
            for j, (s2, e2) in enumerate(intervals):
                if i < j and lanes[i] == lanes[j]:
                    assert e1 <= s2 or e2 <= s1, (intervals[i], intervals[j])
        max_concurrent = max(sum(s <= t < e for s, e in intervals) for t in range(0, 131))
        assert len(set(lanes)) == max(1, max_concurrent)
        assert set(lanes) == set(range(len(set(lanes))))  # lanes are 0..n-1, no gaps
