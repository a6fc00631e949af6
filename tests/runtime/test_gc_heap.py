"""`freeze_startup_heap`: what is alive after start-up leaves the cyclic GC's scans."""

from __future__ import annotations

import gc

import pytest

from asyncpp.runtime.gc_heap import YOUNG_THRESHOLD, freeze_startup_heap


@pytest.fixture(autouse=True)
def _restore_thresholds():
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)


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


def test_young_collections_wait_for_more_than_a_steps_transient_objects():
    gc.set_threshold(700, 10, 10)
    freeze_startup_heap()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    gc.set_threshold(10 * YOUNG_THRESHOLD, 5, 5)
    freeze_startup_heap()  # a higher one is kept
    assert gc.get_threshold() == (10 * YOUNG_THRESHOLD, 5, 5)
    gc.unfreeze()


def test_freeze_can_be_turned_off(monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv("ASYNCPP_GC_FREEZE", "0")
    gc.set_threshold(700, 10, 10)
    assert freeze_startup_heap() == 0 and gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)
