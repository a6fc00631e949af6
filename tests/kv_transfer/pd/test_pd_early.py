"""Early handover: the decode engine is given a request while the prefill engine computes its
prompt, reads the prompt's KV as soon as each prefill stage has it, and goes on once the prefill's
first token comes. Greedy output equals one engine's, every block comes back, faults fail alone."""

from __future__ import annotations

import time

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.engine.outputs import Completion
from asyncpp.errors import InvalidRequestError
from asyncpp.sampling.params import SamplingParams
from tests.kv_transfer.pd.pd_harness import assert_idle, drain, pd_pair_early, serve_pd_early, start_early
from tests.kv_transfer.pd.test_pd_engine import GREEDY, PAIRS, expected, prompts  # noqa: F401  (module fixtures)

pytest.importorskip("nixl_cu12")

@pytest.mark.parametrize("prefill_side,decode_side", PAIRS, ids=lambda p: f"pp{p[0]}")
def test_early_handover_greedy_output_equals_one_engine(tiny_hf_dir, prompts, expected, prefill_side, decode_side):  # noqa: F811
    producer, consumer = pd_pair_early(tiny_hf_dir, *prefill_side, *decode_side)
    try:
        completions = serve_pd_early(producer, consumer, prompts, GREEDY)
        assert [c.error for c in completions] == [None] * len(prompts)
        assert [c.token_ids for c in completions] == expected
        stats = consumer.kv_connector.stats()
        assert stats["pd_num_pulls"] == len(prompts)
        assert stats["pd_num_pulled_tokens"] == sum(len(p) for p in prompts)
        assert consumer.stats()["kv_num_handovers"] == len(prompts)
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("chunk", [32, 24], ids=["block-aligned", "unaligned"])
def test_chunked_prompts_are_read_chunk_by_chunk(tiny_hf_dir, prompts, expected, chunk):  # noqa: F811
    """Each prefill chunk's blocks are read as soon as that chunk is computed (a chunk that ends
    inside a block leaves it for the next notice); output is unchanged."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 2, (1, 3), 3, (2, 1, 1), scheduler={"max_num_batched_tokens": chunk})
    try:
        prompt = prompts[-1]  # 100 tokens: several chunks
        pid, cid = start_early(producer, consumer, prompt, GREEDY, "x")
        consumer.step()  # admitted: every stage awaits the producer's notices
        producer.step()  # the first chunk
        workers = [r.kv_connector.connector for r in consumer.executor.runners]
        first = chunk // 16  # whole blocks of the first chunk
        deadline = time.monotonic() + 60  # polls until NIXL delivered every stage's notice: its blocks are read
        while min(min(w._pulls[cid].next_block.values()) for w in workers) < first and time.monotonic() < deadline:
            consumer.step()
        assert [min(w._pulls[cid].next_block.values()) for w in workers] == [first] * 3
        assert all(w._pulls[cid].awaited_ranks for w in workers)  # not done: more chunks come
        consumer.abort(cid)
        producer.abort(pid)
        drain(producer, consumer, [])
        assert_idle(producer, consumer)
        completions = serve_pd_early(producer, consumer, prompts, GREEDY)
        assert [c.token_ids for c in completions] == expected
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_a_request_stopped_at_its_first_token_aborts_nothing_held(tiny_hf_dir, prompts, expected):  # noqa: F811
    """The prefill's token ends the request (a stop token): the producer holds nothing, the router
    aborts the decode request, which frees its blocks and answers late notices."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 1, (), 2, (3, 1))
    try:
        stop = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[expected[-1][0]])
        pid, cid = start_early(producer, consumer, prompts[-1], stop, "s")
        done = prefill_until_finished(producer, consumer, pid)
        assert done.finish_reason == "stop" and done.kv_transfer_params is None
        consumer.abort(cid)
        drain(producer, consumer, [])
        assert producer.scheduler.num_timed_out_transfers == 0
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_a_stop_string_in_the_first_token_ends_the_request_nothing_held(tiny_hf_dir, prompts, expected):  # noqa: F811
    """The prefill's token completes a stop string (found after the scheduler finished it at its one
    token): the producer hands out no params and frees its blocks although the consumer read them
    meanwhile; the router aborts the decode request. Nothing waits for a timeout; both serve on."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 2, (3, 1), 2, (1, 3), kv_transfer={"pull_timeout_s": 60.0})
    try:
        stop = producer.tokenizer.decode(expected[-1][:1], skip_special_tokens=True).strip()
        assert stop, "the last prompt's first token has no text to stop at"
        params = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])
        pid, cid = start_early(producer, consumer, prompts[-1], params, "s")
        done = prefill_until_finished(producer, consumer, pid)
        assert (done.finish_reason, done.stop_reason, done.kv_transfer_params) == ("stop", stop, None)
        consumer.abort(cid)
        drain(producer, consumer, [])
        assert producer.scheduler.num_timed_out_transfers == consumer.scheduler.num_timed_out_transfers == 0
        assert_idle(producer, consumer)
        assert [c.token_ids for c in serve_pd_early(producer, consumer, prompts[-2:], GREEDY)] == expected[-2:]
    finally:
        consumer.close()
        producer.close()


def test_abort_while_awaiting_frees_blocks_on_both_sides(tiny_hf_dir, prompts, expected):  # noqa: F811
    """The client goes while the prefill runs: the decode request is aborted before any notice, the
    prefill finishes and holds its blocks; the consumer's stages answer the late notices, so the
    producer frees them without waiting for its timeout. Both keep serving."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 2, (3, 1), 2, (1, 3), kv_transfer={"pull_timeout_s": 60.0})
    try:
        pid, cid = start_early(producer, consumer, prompts[-1], GREEDY, "a")
        consumer.step()
        consumer.abort(cid)
        drain(producer, consumer, [pid])
        assert producer.scheduler.num_timed_out_transfers == 0
        assert_idle(producer, consumer)
        assert [c.token_ids for c in serve_pd_early(producer, consumer, prompts[-2:], GREEDY)] == expected[-2:]
    finally:
        consumer.close()
        producer.close()


def test_bad_remote_prefill_params_fail_the_request_alone(tiny_hf_dir, prompts, expected):  # noqa: F811
    producer, consumer = pd_pair_early(tiny_hf_dir, 1, (), 1, ())
    try:
        pid, cid = start_early(producer, consumer, prompts[-1], GREEDY, "f")
        awaited = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": pid}
        with pytest.raises(InvalidRequestError, match="awaited by another request"):  # its KV is read once
            consumer.add_request(prompts[-1], GREEDY, "c-f2", awaited)
        other_pid, other_cid = start_early(producer, consumer, prompts[-2], GREEDY, "g")
        done, other = prefill_until_finished(producer, consumer, pid, other_pid)
        good = done.kv_transfer_params
        for params in (
            {**good, "first_token_id": good["first_token_id"] + 1},  # altered: the signature fails
            {**good, "remote_request_id": other_pid},  # another request's
            [1, 2],
        ):
            with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
                consumer.add_remote_prefill(cid, params)
        with pytest.raises(InvalidRequestError, match="request_id"):
            consumer.add_remote_prefill("nobody", good)
        consumer.add_remote_prefill(cid, good)
        with pytest.raises(InvalidRequestError, match="awaits no remote prefill"):
            consumer.add_remote_prefill(cid, good)  # twice
        consumer.add_remote_prefill(other_cid, other.kv_transfer_params)
        rests = drain(producer, consumer, [cid, other_cid])
        assert done.token_ids + rests[cid].token_ids == expected[-1]
        assert other.token_ids + rests[other_cid].token_ids == expected[-2]
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_awaited_params_are_checked_at_admission(tiny_hf_dir, prompts):  # noqa: F811
    producer, consumer = pd_pair_early(tiny_hf_dir, 1, (), 1, ())
    try:
        awaited = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": "r"}
        for params in (
            {**awaited, "remote_engine_id": "nobody"},
            {**awaited, "remote_request_id": 7},
            {**awaited, "extra": 1},
            {**awaited, "do_remote_prefill": "yes"},
        ):
            with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
                consumer.add_request(prompts[0], GREEDY, kv_transfer_params=params)
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            consumer.add_request(prompts[0], SamplingParams(max_tokens=1), kv_transfer_params=awaited)
        with pytest.raises(InvalidRequestError, match="decode_engine_id"):
            producer.add_request(prompts[0], GREEDY, kv_transfer_params={"do_remote_decode": True, "decode_engine_id": "x"})
        assert not consumer.has_unfinished_requests() and not producer.has_unfinished_requests()
        drain(producer, consumer, [])
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_a_first_token_that_never_comes_fails_the_request(tiny_hf_dir, prompts, expected):  # noqa: F811
    """The producer computed the prompt and the consumer read it, but the params never come (the
    router died): the request fails after load_timeout_s, its blocks come back; others go on."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 1, (), 1, (), kv_transfer={"load_timeout_s": 0.5})
    try:
        pid, cid = start_early(producer, consumer, prompts[-1], GREEDY, "t")
        prefill_until_finished(producer, consumer, pid)
        other = consumer.add_request(prompts[3], GREEDY)
        outs = {}
        deadline = time.monotonic() + 10
        while (consumer.has_unfinished_requests() or producer.has_pending_transfers()) and time.monotonic() < deadline:
            for engine in (consumer, producer):
                for out in engine.step():
                    outs.setdefault(out.request_id, []).append(out)
        assert outs[cid][-1].finish_reason == "error" and "first token" in outs[cid][-1].error
        assert [t for o in outs[other] for t in o.token_ids] == expected[3]
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def prefill_until_finished(producer: Engine, consumer: Engine, *pids: str, max_steps: int = 1000):
    """Step both (the consumer polls for the notices) until the producer's requests finished."""
    done = {pid: Completion(pid) for pid in pids}
    for _ in range(max_steps):
        for out in producer.step():
            if out.request_id in done:
                done[out.request_id].add(out)
        consumer.step()
        if all(c.finish_reason is not None for c in done.values()):
            return done[pids[0]] if len(pids) == 1 else [done[pid] for pid in pids]
    raise AssertionError("the producer did not finish")


def test_a_producer_preemption_voids_what_was_read(tiny_hf_dir, prompts, expected):  # noqa: F811
    """The producer preempts a request after its first chunk was read (its blocks are freed and may be
    reused meanwhile): a void notice makes every consumer stage read every chunk again. Shown by
    zeroing what the consumer read before: the output is still exact."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 2, (1, 3), 2, (3, 1), scheduler={"max_num_batched_tokens": 32})
    try:
        pid, cid = start_early(producer, consumer, prompts[-1], GREEDY, "v")
        consumer.step()  # admitted: awaiting
        producer.step()  # the first chunk (2 blocks)
        # Read: each consumer stage, once its producer stage's ready notice is in (NIXL delivers
        # notices asynchronously: on a busy machine one may need a few more polls).
        pulls = [runner.kv_connector.connector._pulls[cid] for runner in consumer.executor.runners]
        deadline = time.monotonic() + 60
        while min(n for pull in pulls for n in pull.next_block.values()) < 2 and time.monotonic() < deadline:
            consumer.step()
        block_ids = consumer.block_manager.block_ids(cid)[:2]
        for runner, pull in zip(consumer.executor.runners, pulls, strict=True):
            assert min(pull.next_block.values()) == 2
            for k, v in runner.kv_caches:
                for b in block_ids:
                    k[b * 16 : (b + 1) * 16].zero_()
                    v[b * 16 : (b + 1) * 16].zero_()
        producer.scheduler._preempt(producer.scheduler.get_request(pid))  # as when it runs out of blocks
        first = prefill_until_finished(producer, consumer, pid)
        consumer.add_remote_prefill(cid, first.kv_transfer_params)
        rest = drain(producer, consumer, [cid])[cid]
        assert first.token_ids + rest.token_ids == expected[-1]
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_prefix_hits_on_the_decode_side_read_only_the_rest(tiny_hf_dir, prompts, expected):  # noqa: F811
    """The same prompts again: the decode engine's prefix cache has their first blocks, so its stages
    read only the blocks after them (from the producer's block ids past the hit); output is exact."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 2, (1, 3), 2, (3, 1), scheduler={"max_num_batched_tokens": 32})
    try:
        assert [c.token_ids for c in serve_pd_early(producer, consumer, prompts, GREEDY)] == expected
        pulled = consumer.kv_connector.stats()["pd_num_pulled_tokens"]
        assert [c.token_ids for c in serve_pd_early(producer, consumer, prompts, GREEDY)] == expected
        hits = consumer.stats()["num_prefix_cache_hit_tokens"]
        assert hits > 0 and consumer.kv_connector.stats()["pd_num_pulled_tokens"] - pulled == pulled - hits
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_awaiting_a_prefill_leaves_running_requests_a_block_each(tiny_hf_dir):
    """The decode engine gives an awaited prompt its blocks only if every running request keeps a free
    block to grow into: a wait for a prefill never takes what a decode needs next."""
    producer, consumer = pd_pair_early(tiny_hf_dir, 1, (), 1, (), cache={"block_size": 16, "kv_cache_memory_mb": 1})
    try:
        running = []
        while consumer.block_manager.num_free_blocks > 16:  # an awaited prompt fits max_model_len
            running.append(consumer.add_request([5 + len(running)] * 100, GREEDY))  # 7 blocks, room to 112 tokens
            consumer.step()
        free = consumer.block_manager.num_free_blocks
        assert consumer.scheduler.num_running == len(running) >= 2 and free >= 3
        awaited = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": "p"}
        consumer.add_request([200] * ((free - 1) * 16 - 3), GREEDY, "c", awaited)  # needs all but one free block
        consumer.step()
        assert consumer.scheduler.num_waiting_for_remote_kvs == 0  # it would leave one block for them all
        consumer.abort(running[0])
        consumer.step()
        assert consumer.scheduler.num_waiting_for_remote_kvs == 1
        assert consumer.scheduler.stats().num_preemptions == 0
        for request_id in ["c", *running[1:]]:
            consumer.abort(request_id)
        drain(producer, consumer, [])
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()
