"""A void notice (the producer preempted a request whose chunks were read) supersedes the reads made
so far: each consumer stage waits for them to end before it reads those blocks again; one that
cannot be stopped fails its request alone and keeps its blocks out of the free pool."""

from __future__ import annotations

import time

import pytest

from asyncpp.transport.nixl_agent import TransferState
from tests.kv_transfer.pd.pd_harness import assert_idle, drain, finish, pd_pair_early, start_early
from tests.kv_transfer.pd.test_pd_early import prefill_until_finished
from tests.kv_transfer.pd.test_pd_engine import GREEDY, expected, prompts  # noqa: F401  (module fixtures)

pytest.importorskip("nixl_cu12")


def first_chunk_read(producer, consumer, cid):
    """Step until every consumer stage read the first chunk (2 blocks); its pulls and their reads."""
    producer.step()
    pulls = [runner.kv_connector.connector._pulls[cid] for runner in consumer.executor.runners]
    deadline = time.monotonic() + 60
    while min(n for pull in pulls for n in pull.next_block.values()) < 2 and time.monotonic() < deadline:
        consumer.step()
    assert all(min(pull.next_block.values()) == 2 for pull in pulls)
    return pulls, [handle for pull in pulls for handle in pull.handles]


def test_a_void_notice_waits_for_the_reads_it_supersedes(tiny_hf_dir, prompts, expected):  # noqa: F811
    producer, consumer = pd_pair_early(tiny_hf_dir, 2, (1, 3), 2, (3, 1), scheduler={"max_num_batched_tokens": 32})
    try:
        pid, cid = start_early(producer, consumer, prompts[-1], GREEDY, "v")
        consumer.step()
        pulls, _ = first_chunk_read(producer, consumer, cid)
        old = [list(pull.handles) for pull in pulls]  # per stage: its reads of the first chunk
        logs = []  # per stage: its reads and releases, in order
        for runner in consumer.executor.runners:
            events = []
            logs.append(events)
            transport = runner.kv_connector.connector.transport
            read, release = transport.read, transport.release

            def logged_read(*args, read=read, events=events, **kwargs):
                handle = read(*args, **kwargs)
                events.append(("read", handle))
                return handle

            def logged_release(handle, release=release, events=events):
                release(handle)
                events.append(("release", handle))

            transport.read, transport.release = logged_read, logged_release
        producer.scheduler._preempt(producer.scheduler.get_request(pid))
        first = prefill_until_finished(producer, consumer, pid)
        consumer.add_remote_prefill(cid, first.kv_transfer_params)
        rest = drain(producer, consumer, [cid])[cid]
        assert first.token_ids + rest.token_ids == expected[-1]
        # Each stage's first reads from a producer stage ended before it read from that stage again.
        for handles, events in zip(old, logs, strict=True):
            assert handles
            released_at = {id(handle): i for i, (what, handle) in enumerate(events) if what == "release"}
            for handle in handles:
                again = next(i for i, (what, h) in enumerate(events) if what == "read" and h.remote == handle.remote)
                assert released_at[id(handle)] < again
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_a_superseded_read_that_cannot_be_stopped_fails_its_request_alone(tiny_hf_dir, prompts, expected):  # noqa: F811
    producer, consumer = pd_pair_early(tiny_hf_dir, 2, (1, 3), 2, (3, 1), scheduler={"max_num_batched_tokens": 32})
    try:
        pid, cid = start_early(producer, consumer, prompts[-1], GREEDY, "v")
        consumer.step()
        _, old = first_chunk_read(producer, consumer, cid)
        stuck = {id(handle) for handle in old}
        for runner in consumer.executor.runners:
            transport = runner.kv_connector.connector.transport
            poll, release = transport.poll, transport.release

            def stuck_poll(handle, poll=poll):
                return TransferState.RUNNING if id(handle) in stuck else poll(handle)

            def stuck_release(handle, release=release):
                if id(handle) in stuck:
                    raise TimeoutError("the read is still running")
                release(handle)

            transport.poll, transport.release = stuck_poll, stuck_release
        block_ids = consumer.block_manager.block_ids(cid)
        producer.scheduler._preempt(producer.scheduler.get_request(pid))
        other = consumer.add_request(prompts[3], GREEDY)
        out = finish(producer, consumer, [cid, other])  # the producer finishes; its params go nowhere
        assert out[cid].finish_reason == "error" and "could not be stopped" in out[cid].error
        assert out[other].token_ids == expected[3]
        bm = consumer.block_manager
        assert all(bm.is_quarantined(b) for b in block_ids)
        assert bm.num_free_blocks == bm.num_blocks - len(block_ids)
        assert_idle(producer)  # told by the failed pull: the producer's blocks are free
        stuck.clear()  # the transport confirms: they come back with the next step
        last = consumer.add_request(prompts[0], GREEDY)
        assert drain(producer, consumer, [last])[last].token_ids == expected[0]
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()
