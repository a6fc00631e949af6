"""Prefill/decode disaggregation, paths no other test reached (found by mutation testing): a NIXL read
that reports failure, or whose handle cannot be released, fails its request alone and frees the
producer's blocks; the consumer refuses block ids that are not ints before checking the signature."""

from __future__ import annotations

import pytest

from asyncpp.kv_transfer.pd.params import RemotePrefill
from asyncpp.sampling.params import SamplingParams
from tests.kv_transfer.pd.pd_harness import assert_idle, drain, pd_pair, prefill
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


def test_a_read_whose_handle_cannot_be_released_fails_its_request_alone(tiny_hf_dir, prompts, expected):  # noqa: F811
    def break_transport(transport):
        release = transport.release

        def release_late(handle):
            release(handle)
            raise TimeoutError("the read is still running")  # NIXL could not stop it: its blocks are suspect

        transport.release = release_late

    failed, other = serve_with_broken_reads(tiny_hf_dir, prompts, break_transport)
    assert failed.finish_reason == "error" and "failed to load" in failed.error
    assert other.token_ids == expected[3]


@pytest.mark.parametrize("block_ids", [["3"], [1.0], [True]])
def test_block_ids_that_are_not_ints_are_refused(block_ids):
    params = RemotePrefill("prefill", "r", [3], 16, "0" * 64, 5, 0.0, "", 1.0, "ab").signed(b"key")
    with pytest.raises(TypeError, match="remote_block_ids"):
        RemotePrefill.parse({**params, "remote_block_ids": block_ids})
