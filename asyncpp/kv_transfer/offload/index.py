"""`OffloadIndex`: the engine's map from block hash to store slot, with LRU eviction.

The stores hold `num_slots` records each; this index decides which hash
lives in which slot, the same on every stage. An entry is PENDING from the
moment a save is issued until every stage has reported it (then READY, and
loadable), and a READY entry may be pinned by loads in flight. Eviction
takes the least recently used READY entry that is not pinned: a slot being
written or read is never handed to another block.

Invariants: slots are unique; `num_free_slots + len(entries) == num_slots`;
`discard` of a pinned entry marks it, and it leaves on its last unpin.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

PENDING = "pending"
READY = "ready"


@dataclass
class _Entry:
    slot: int
    state: str
    num_pins: int = 0
    is_discarded: bool = False


class OffloadIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_ready(self) -> int:
        return sum(1 for e in self._entries.values() if e.state == READY)

    @property
    def num_pending(self) -> int:
        return sum(1 for e in self._entries.values() if e.state == PENDING)

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.num_pins)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def slot_of(self, block_hash: bytes) -> int | None:
        entry = self._entries.get(block_hash)
        return entry.slot if entry is not None else None

    def is_ready(self, block_hash: bytes) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry.state == READY and not entry.is_discarded

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading hashes are READY (LRU order unchanged)."""
        for i, block_hash in enumerate(hashes):
            if not self.is_ready(block_hash):
                return i
        return len(hashes)

    # ---- loads ----------------------------------------------------------------------------
    def pin(self, hashes: Sequence[bytes]) -> list[int]:
        """Pin READY entries for a load (and mark them used); their slots."""
        for block_hash in hashes:
            if not self.is_ready(block_hash):
                raise KeyError(f"block {block_hash.hex()[:16]} is not ready to load")
        slots = []
        for block_hash in hashes:
            entry = self._entries[block_hash]
            entry.num_pins += 1
            self._entries.move_to_end(block_hash)
            slots.append(entry.slot)
        return slots

    def unpin(self, hashes: Sequence[bytes]) -> None:
        for block_hash in hashes:
            entry = self._entries.get(block_hash)
            if entry is None or entry.num_pins == 0:
                continue
            entry.num_pins -= 1
            if entry.num_pins == 0 and entry.is_discarded:
                self._drop(block_hash)

    # ---- saves ----------------------------------------------------------------------------
    def prepare_store(self, hashes: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Slots for the hashes not stored yet (PENDING from now); stops when nothing can be evicted."""
        placed = []
        for block_hash in hashes:
            if block_hash in self._entries or any(h == block_hash for h, _ in placed):
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._entries[block_hash] = _Entry(slot, PENDING)
            placed.append((block_hash, slot))
        return placed

    def complete_store(self, hashes: Sequence[bytes], success: bool = True) -> None:
        for block_hash in hashes:
            entry = self._entries.get(block_hash)
            if entry is None or entry.state != PENDING:
                continue
            if success:
                entry.state = READY
                self._entries.move_to_end(block_hash)
            else:
                self._drop(block_hash)

    def discard(self, hashes: Sequence[bytes]) -> None:
        """Forget blocks found bad; a pinned one leaves on its last unpin."""
        for block_hash in hashes:
            entry = self._entries.get(block_hash)
            if entry is None:
                continue
            if entry.num_pins:
                entry.is_discarded = True
            else:
                self._drop(block_hash)

    def restore(self, entries: Sequence[tuple[int, bytes]]) -> None:
        """At start-up: these (slot, hash) pairs are READY, oldest first."""
        free = set(self._free_slots)
        for slot, block_hash in entries:
            if slot not in free or block_hash in self._entries:
                continue
            free.discard(slot)
            self._entries[block_hash] = _Entry(slot, READY)
        self._free_slots = sorted(free, reverse=True)

    # ---- helpers --------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._entries.items():  # least recently used first
            if entry.state == READY and entry.num_pins == 0:
                del self._entries[block_hash]
                return entry.slot
        return None

    def _drop(self, block_hash: bytes) -> None:
        entry = self._entries.pop(block_hash)
        self._free_slots.append(entry.slot)
