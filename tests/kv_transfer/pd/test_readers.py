"""A producer stage's count of its handouts' readers, and the messages that carry it (no NIXL needed)."""

from __future__ import annotations

from asyncpp.kv_transfer.pd.params import ReadyNotice
from asyncpp.kv_transfer.pd.readers import HandoutReaders, notification, parse_notification


def test_notifications_and_ready_notices_round_trip_with_bars_in_the_request_id():
    assert parse_notification(notification("r|1", "ab12", 2, 3)) == ("r|1", "ab12", 2, 3)
    assert parse_notification(b"no bars") is None
    notice = ReadyNotice("prefill", "r|1", "ab12", 1, 100, 48, [4, 5, 6])
    assert ReadyNotice.decode(notice.encode()) == notice
    void = ReadyNotice("prefill", "r", "ab12", 0, 0, -1, [])
    assert ReadyNotice.decode(void.encode()) == void and void.is_void
    assert ReadyNotice.decode(notification("r", "ab12", 0, 1)) is None


def test_a_hold_ends_when_every_reader_of_its_handout_notified():
    readers = HandoutReaders(pull_timeout_s=10.0, pp_rank=0)
    readers.on_notification("r", "n1", 0, 2, now=0.0)  # before the hold: kept
    readers.hold(["r"], {"r": "n1"})
    assert readers.take_done(now=1.0) == frozenset()  # one of two consumer stages
    readers.on_notification("r", "n1", 1, 2, now=1.0)
    assert readers.take_done(now=1.0) == {"r"}
    assert readers.take_done(now=1.0) == frozenset()  # reported once


def test_readers_of_another_handout_never_count_and_are_dropped_after_the_pull_timeout():
    readers = HandoutReaders(pull_timeout_s=10.0, pp_rank=0)
    readers.hold(["r"], {"r": "n2"})
    readers.on_notification("r", "n1", 0, 1, now=0.0)  # replayed params of an older request "r"
    assert readers.take_done(now=1.0) == frozenset()
    assert readers.take_done(now=11.0) == frozenset()
    assert ("r", "n1") not in readers._readers  # dropped while "r" is still held
    readers.on_notification("r", "", 0, 1, now=12.0)  # a stage that read nothing: releases any handout
    assert readers.take_done(now=12.0) == {"r"}


def test_an_aborted_hold_forgets_its_notifications():
    readers = HandoutReaders(pull_timeout_s=10.0, pp_rank=0)
    readers.hold(["r"], {"r": "n1"})
    readers.on_notification("r", "n1", 0, 2, now=0.0)
    readers.forget("r")
    readers.hold(["r"], {"r": "n1"})  # the same id held again (it cannot be, but if it were)
    readers.on_notification("r", "n1", 1, 2, now=1.0)
    assert readers.take_done(now=1.0) == frozenset()  # the first notification was forgotten
