"""Shared fixtures of the KV-transfer tests."""

from __future__ import annotations

import os
import uuid

import pytest

from asyncpp.kv_transfer.offload.store import DirBlockStore, ShmBlockStore, StoreLayout
from tests.runtime.harness import shm_segments


@pytest.fixture(params=["shm", "dir"])
def make_store(request, tmp_path):
    """`make(layout)`: a new offload store of that layout, in shared memory or in a directory; each is
    closed (and its segment removed) after the test, which must leave no segment behind."""
    made = []
    prefix = f"asyncpp-test-kvstore-{os.getpid()}-"

    def make(lay: StoreLayout, name: str | None = None):
        name = name or uuid.uuid4().hex[:8]
        if request.param == "shm":
            store = ShmBlockStore(prefix + uuid.uuid4().hex[:8], lay, create=True)
        else:
            store = DirBlockStore(tmp_path / name, lay)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
        if isinstance(store, ShmBlockStore):
            store.unlink()
    assert not shm_segments(prefix)
