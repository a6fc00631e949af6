"""`freeze_startup_heap`: what is alive after start-up leaves the cyclic GC's scans."""

from __future__ import annotations

import gc

from asyncpp.runtime.gc_heap import freeze_startup_heap


def test_freeze_moves_the_live_heap_out_of_collections():
    gc.unfreeze()
    kept = [[i] for i in range(1000)]  # containers, tracked by the GC
    try:
        assert freeze_startup_heap() >= len(kept)
        # gc.get_objects() lists the generations collections scan, not the frozen one. (The frozen
        # count itself may drop meanwhile: frozen objects are still freed when unreferenced.)
        scanned = {id(o) for o in gc.get_objects()}
        assert not any(id(k) in scanned for k in kept)
    finally:
        gc.unfreeze()
    assert id(kept[0]) in {id(o) for o in gc.get_objects()}  # back under the GC once unfrozen


def test_freeze_can_be_turned_off(monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv("ASYNCPP_GC_FREEZE", "0")
    assert freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
