"""`freeze_startup_heap`: what is alive after start-up leaves the cyclic GC's scans."""

from __future__ import annotations

import gc

from asyncpp.runtime.gc_heap import freeze_startup_heap


def test_freeze_moves_the_live_heap_out_of_collections():
    gc.unfreeze()
    kept = [[i] for i in range(1000)]  # containers, tracked by the GC
    try:
        num_frozen = freeze_startup_heap()
        assert num_frozen >= len(kept) and gc.get_freeze_count() == num_frozen
        assert sum(gc.get_count()) < 10  # a collection ran first: nothing young is left behind
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_freeze_can_be_turned_off(monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv("ASYNCPP_GC_FREEZE", "0")
    assert freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
