"""Prefill/decode disaggregation, paths no other test reached (found by mutation testing): a NIXL read
that reports failure, or that cannot be stopped, fails its request alone and frees the producer's
blocks (a read that cannot be stopped keeps its own blocks quarantined until it ends); the consumer
refuses block ids that are not ints before checking the signature."""

from __future__ import annotations

import pytest

from asyncpp.kv_transfer.pd.params import RemotePrefill
from asyncpp.sampling.params import SamplingParams
from tests.kv_transfer.pd.pd_harness import assert_idle, drain, finish, pd_pair, prefill
from tests.kv_transfer.pd.test_pd_engine import expected, prompts  # noqa: F401  (module fixtures)

pytest.importorskip("nixl_cu12")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def consumer_workers(consumer):
    return [runner.kv_connector.connector for runner in consumer.executor.runners]


def serve_with_broken_reads(tiny_hf_dir, prompts, break_transport):  # noqa: F811
    """One pulled request and one plain one on the consumer; `break_transport(transport)` first."""
    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 2, (3, 1))
    try:
        [done] = prefill(producer, [prompts[-1]])
        for worker in consumer_workers(consumer):
            break_transport(worker.transport)
        rid = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=done.kv_transfer_params)
        other = consumer.add_request(prompts[3], GREEDY)
        out = drain(producer, consumer, [rid, other])
        assert_idle(producer, consumer)  # the producer's held blocks were released too
        return out[rid], out[other]
    finally:
        consumer.close()
        producer.close()


def test_a_read_that_fails_fails_its_request_alone(tiny_hf_dir, prompts, expected):  # noqa: F811
    from asyncpp.transport.nixl_agent import TransferState

    def break_transport(transport):
        transport.poll = lambda handle: TransferState.FAILED

    failed, other = serve_with_broken_reads(tiny_hf_dir, prompts, break_transport)
    assert failed.finish_reason == "error" and "failed to load" in failed.error
    assert other.token_ids == expected[3]


def test_an_unstoppable_read_keeps_its_blocks_out_of_the_free_pool(tiny_hf_dir, prompts, expected):  # noqa: F811
    """NIXL cannot stop a running read (`release` raises): its request fails alone, its blocks stay
    quarantined (never free, never handed to another request) until the transport says it ended."""
    from asyncpp.transport.nixl_agent import TransferState

    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 2, (3, 1), kv_transfer={"load_timeout_s": 0.2})
    try:
        [done] = prefill(producer, [prompts[-1]])
        workers = consumer_workers(consumer)
        unbroken = [(w.transport.poll, w.transport.release) for w in workers]

        def release_never(handle):
            raise TimeoutError("the read is still running")

        for worker in workers:
            worker.transport.poll = lambda handle: TransferState.RUNNING
            worker.transport.release = release_never
        rid = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=done.kv_transfer_params)
        other = consumer.add_request(prompts[3], GREEDY)
        out = finish(producer, consumer, [rid, other])
        assert out[rid].finish_reason == "error" and "load_timeout_s" in out[rid].error
        assert "could not be stopped" in out[rid].error
        assert out[other].token_ids == expected[3]
        bm = consumer.block_manager
        quarantined = [b for b in range(bm.num_blocks) if bm.is_quarantined(b)]
        assert len(quarantined) == len(done.kv_transfer_params["remote_block_ids"])
        assert consumer.stats()["kv_num_quarantined_blocks"] == len(quarantined)
        # Requests that need every other block still come out exact, and never get those.
        more = [consumer.add_request(p, GREEDY) for p in prompts[:6]]
        out = finish(producer, consumer, more)
        assert [out[r].token_ids for r in more] == expected[:6]
        assert all(bm.ref_count(b) == len(workers) for b in quarantined)  # one per stage's read, no request's
        assert bm.num_free_blocks == bm.num_blocks - len(quarantined)
        assert consumer.has_pending_transfers()  # it keeps polling the reads
        assert_idle(producer)  # the producer was told: its blocks are free
        # The transport confirms the read ended: the blocks come back with the next step.
        for worker, (poll, release) in zip(workers, unbroken):
            worker.transport.poll, worker.transport.release = poll, release
        last = consumer.add_request(prompts[0], GREEDY)
        assert drain(producer, consumer, [last])[last].token_ids == expected[0]
        assert consumer.stats()["kv_num_quarantined_blocks"] == 0
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("block_ids", [["3"], [1.0], [True]])
def test_block_ids_that_are_not_ints_are_refused(block_ids):
    params = RemotePrefill("prefill", "r", [3], 16, "0" * 64, 5, 0.0, "", 1.0, "ab").signed(b"key")
    with pytest.raises(TypeError, match="remote_block_ids"):
        RemotePrefill.parse({**params, "remote_block_ids": block_ids})
