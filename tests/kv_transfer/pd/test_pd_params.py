"""Signed params are used once: a replay after the producer reused their blocks, a second use while
the first still reads, a use by another engine than the one they were handed to, are refused (the
request fails alone); a producer counts only the readers of the handout it holds blocks for."""

from __future__ import annotations

import pytest

from asyncpp.errors import InvalidRequestError
from asyncpp.kv_transfer.pd.readers import notification
from asyncpp.sampling.params import SamplingParams
from tests.kv_transfer.pd.pd_harness import assert_idle, drain, pd_engine, pd_pair, prefill
from tests.kv_transfer.pd.test_pd_engine import expected, prompts  # noqa: F401  (module fixtures)

pytest.importorskip("nixl_cu12")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# No prefix cache on the producer: freed blocks are taken again first, in table order.
NO_PREFIX_CACHE = {"block_size": 16, "kv_cache_memory_mb": 4, "enable_prefix_caching": False}


def test_replayed_params_are_refused_once_the_producer_reused_their_blocks(tiny_hf_dir, prompts, expected):  # noqa: F811
    producer = pd_engine(tiny_hf_dir, "producer", "prefill", 1, (), cache=NO_PREFIX_CACHE)
    consumer = pd_engine(tiny_hf_dir, "consumer", "decode", 1, ())
    try:
        consumer.kv_connector.add_remote_engine(producer.kv_connector.engine_handshake())
        [a] = prefill(producer, [prompts[-1]])
        rid = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=a.kv_transfer_params)
        assert a.token_ids + drain(producer, consumer, [rid])[rid].token_ids == expected[-1]
        assert_idle(producer, consumer)  # pulled: the producer freed the blocks
        [b] = prefill(producer, [prompts[4]])  # another prompt, computed into some of the same blocks
        reused = set(b.kv_transfer_params["remote_block_ids"]) & set(a.kv_transfer_params["remote_block_ids"])
        assert reused
        with pytest.raises(InvalidRequestError, match="used here already") as info:
            consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=a.kv_transfer_params)
        assert info.value.field == "kv_transfer_params"
        rid = consumer.add_request(prompts[4], GREEDY, kv_transfer_params=b.kv_transfer_params)
        assert b.token_ids + drain(producer, consumer, [rid])[rid].token_ids == expected[4]
        assert consumer.kv_connector.stats()["pd_num_refused_replays"] == 1
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_a_second_use_while_the_first_reads_is_refused(tiny_hf_dir, prompts, expected):  # noqa: F811
    producer, consumer = pd_pair(tiny_hf_dir, 2, (1, 3), 2, (3, 1))
    other = pd_engine(tiny_hf_dir, "consumer", "elsewhere", 1, ())
    try:
        producer.kv_connector.add_remote_engine(consumer.kv_connector.engine_handshake())
        other.kv_connector.add_remote_engine(producer.kv_connector.engine_handshake())
        [done] = prefill(producer, [prompts[-1]])
        params = done.kv_transfer_params
        assert params["consumer_engine_id"] == "decode"  # the only engine the producer knows
        first = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=params)
        with pytest.raises(InvalidRequestError, match="used here already"):
            consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=params)
        with pytest.raises(InvalidRequestError, match="handed to engine 'decode'"):
            other.add_request(prompts[-1], GREEDY, kv_transfer_params=params)
        plain = consumer.add_request(prompts[3], GREEDY)
        out = drain(producer, consumer, [first, plain])
        assert done.token_ids + out[first].token_ids == expected[-1]
        assert out[plain].token_ids == expected[3]
        assert not other.has_unfinished_requests()
        assert_idle(producer, consumer)
    finally:
        other.close()
        consumer.close()
        producer.close()


def test_the_producer_counts_only_the_readers_of_its_handout(tiny_hf_dir, prompts, expected):  # noqa: F811
    """Notifications naming another nonce (a replay of older params of the same request id) never
    release the blocks held for this handout; its own reader's do."""
    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 1, ())
    try:
        [done] = prefill(producer, [prompts[-1]])
        params = done.kv_transfer_params
        [worker] = [runner.kv_connector.connector for runner in producer.executor.runners]
        transport_notifs = worker.transport.get_notifs
        stale = [notification(params["remote_request_id"], "0123abcd", 0, 1)]
        worker.transport.get_notifs = lambda: [*stale, *transport_notifs()]
        for _ in range(3):
            producer.step()
        assert producer.scheduler.num_held_for_transfer == 1
        stale.clear()
        rid = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=params)
        assert done.token_ids + drain(producer, consumer, [rid])[rid].token_ids == expected[-1]
        assert producer.scheduler.num_timed_out_transfers == 0  # released by its reader
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()
