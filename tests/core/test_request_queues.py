"""RequestQueues: arrival order is kept in both queues, membership by identity."""

from __future__ import annotations

from sched_helpers import make_request

from asyncpp.core.request_queues import RequestQueues


def test_requeued_request_goes_ahead_of_younger_waiting_ones() -> None:
    queues = RequestQueues()
    a, b, c, d = (make_request(name, [1]) for name in "abcd")
    for request in (a, b, c, d):
        queues.add(request)
    for request in (a, b, c):
        queues.admit(request)
    assert queues.running == [a, b, c] and list(queues.waiting) == [d]
    queues.requeue(c)
    queues.requeue(a)
    assert list(queues.waiting) == [a, c, d]  # by arrival, not by preemption order
    queues.admit(a)
    assert queues.running == [a, b]  # re-admitted into its place, ahead of younger b


def test_youngest_idle_running_skips_in_flight_requests() -> None:
    queues = RequestQueues()
    a, b, c = (make_request(name, [1]) for name in "abc")
    for request in (a, b, c):
        queues.add(request)
        queues.admit(request)
    c.num_in_flight = 1
    assert queues.youngest_idle_running() is b
    a.num_in_flight = b.num_in_flight = 2
    assert queues.youngest_idle_running() is None


def test_remove_is_by_identity() -> None:
    queues = RequestQueues()
    a = make_request("x", [1])
    twin = make_request("x", [1])  # equal fields, different request
    twin.arrival_time = a.arrival_time
    queues.add(a)
    assert twin == a
    queues.remove(twin)
    assert list(queues.waiting) == [a]
    queues.remove(a)
    assert not queues.waiting


def test_a_request_behind_the_head_is_admitted_out_of_order_and_the_rest_keep_theirs() -> None:
    queues = RequestQueues()
    a, b, c = (make_request(name, [1]) for name in "abc")
    for request in (a, b, c):
        queues.add(request)
    queues.admit(b)  # `a` asked to wait (its KV is on its way): `b` goes ahead of it
    assert queues.running == [b] and list(queues.waiting) == [a, c]
    queues.take_waiting(c)
    assert list(queues.waiting) == [a]
