"""Prefill/decode disaggregation between two in-process engines of any PP sizes: greedy output
equals one engine's, every block comes back on both sides, bad params fail alone."""

from __future__ import annotations

import time

import pytest

from asyncpp.engine.engine import Engine
from asyncpp.errors import InvalidRequestError
from asyncpp.kv_transfer.pd.params import RemotePrefill, tokens_digest
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.kv_transfer.pd.pd_harness import assert_idle, drain, pd_pair, prefill, serve_pd, serve_pd_early

pytest.importorskip("nixl_cu12")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# (prefill pp, split), (decode pp, split): splits that do not line up (the tiny model has 4 layers).
PAIRS = [
    ((1, ()), (1, ())),
    ((2, (1, 3)), (3, (2, 1, 1))),
    ((3, (1, 1, 2)), (1, ())),
    ((2, (3, 1)), (2, (1, 3))),
]


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(300, 8) + [[(5 * i) % 290 + 7 for i in range(100)]]


@pytest.fixture(scope="module")
def expected(tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir))
    try:
        return [c.token_ids for c in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()


@pytest.mark.parametrize("prefill_side,decode_side", PAIRS, ids=lambda p: f"pp{p[0]}")
def test_disaggregated_greedy_output_equals_one_engine(tiny_hf_dir, prompts, expected, prefill_side, decode_side):
    producer, consumer = pd_pair(tiny_hf_dir, *prefill_side, *decode_side)
    try:
        completions = serve_pd(producer, consumer, prompts, GREEDY)
        assert [c.token_ids for c in completions] == expected
        assert all(c.error is None for c in completions)
        stats = consumer.kv_connector.stats()
        # Every prompt was pulled, its last block partly filled; its last token was not computed again.
        assert stats["pd_num_pulls"] == len(prompts)
        assert stats["pd_num_pulled_tokens"] == sum(len(p) for p in prompts)
        assert consumer.stats()["kv_blocks_loaded"] > 0
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_pulls_are_never_within_a_plan(tiny_hf_dir):
    """A pull within the plan computing its request made every stage wait for the read before its
    forward (a hung producer stalled the whole engine): `options.pull = "sync"` is refused."""
    from asyncpp.config import ConfigError

    kv = {"connector": "pd", "kv_role": "consumer", "engine_id": "decode", "options": {"pull": "sync"}}
    with pytest.raises(ConfigError, match="pulls are always 'async'"):
        Engine(tiny_config(tiny_hf_dir, kv_transfer=kv))


def test_a_pull_from_a_gone_producer_fails_its_request_alone(tiny_hf_dir, prompts, expected):
    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 2, (3, 1))
    try:
        [done] = prefill(producer, [prompts[-1]])
    finally:
        producer.close()  # its agents are gone: the pull cannot read
    try:
        rid = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=done.kv_transfer_params)
        other = consumer.add_request(prompts[3], GREEDY)
        done_by_id = {}
        while consumer.has_unfinished_requests() or consumer.has_pending_transfers():
            for out in consumer.step():
                done_by_id.setdefault(out.request_id, []).append(out)
        failed = done_by_id[rid][-1]
        assert failed.finish_reason == "error" and "failed to load" in failed.error
        assert [t for o in done_by_id[other] for t in o.token_ids] == expected[3]
        assert_idle(consumer)
    finally:
        consumer.close()


def test_forged_and_malformed_params_fail_alone(tiny_hf_dir, prompts, expected):
    """Each malformed field, signed again with the producer's own key, reaches its own check."""
    producer, consumer = pd_pair(tiny_hf_dir, 2, (1, 3), 1, ())
    try:
        prompt = prompts[-1]
        [done] = prefill(producer, [prompt])
        good = done.kv_transfer_params
        key = producer.kv_connector.engine_handshake().params_key

        def signed(**changes):
            fields = {name: value for name, value in {**good, **changes}.items() if name != "sig"}
            return RemotePrefill(**fields).signed(key)

        blocks = good["remote_block_ids"]
        bad = {  # what -> (params, what the refusal says)
            "not signed by the producer": ({**good, "first_token_id": good["first_token_id"] + 1}, "not signed"),
            "a block missing": (signed(remote_block_ids=blocks[:-1]), "blocks of 16"),
            "not the whole prompt": (signed(num_tokens=80, remote_block_ids=blocks[:5]), "whole prompt"),
            "block ids outside its cache": (signed(remote_block_ids=[b + 10**6 for b in blocks]), "outside engine"),
            "another prompt's tokens": (signed(tokens_sha256=tokens_digest(prompt[::-1])), "another prompt"),
            "handed to another engine": (signed(consumer_engine_id="elsewhere"), "handed to engine 'elsewhere'"),
            "expired": (signed(expires_at=time.time() - 1.0), "expired"),
            "unknown engine": ({**good, "remote_engine_id": "nobody"}, "does not know"),
            "wrong types": ({**good, "num_tokens": "96"}, "num_tokens must be"),
            "a nonce that is not hex": (signed(nonce="a|b"), "nonce must be hex"),
            "not a map": ([1, 2], "must be a map"),
            "missing keys": ({"remote_engine_id": "prefill"}, "missing keys"),
        }
        for what, (params, says) in bad.items():
            with pytest.raises(InvalidRequestError, match=says) as info:
                consumer.add_request(prompt, GREEDY, kv_transfer_params=params)
            assert info.value.field == "kv_transfer_params", what
        with pytest.raises(InvalidRequestError, match="producer takes"):
            producer.add_request(prompt, GREEDY, kv_transfer_params={"do_remote_decode": "yes"})
        # The good one still goes through, exactly, once.
        rid = consumer.add_request(prompt, GREEDY, kv_transfer_params=good)
        with pytest.raises(InvalidRequestError, match="used here already"):
            consumer.add_request(prompt, GREEDY, kv_transfer_params=signed())
        assert done.token_ids + drain(producer, consumer, [rid])[rid].token_ids == expected[-1]
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_nobody_pulls_the_blocks_are_freed_after_the_pull_timeout(tiny_hf_dir, prompts):
    producer, consumer = pd_pair(tiny_hf_dir, 2, (1, 3), 1, (), kv_transfer={"pull_timeout_s": 0.3})
    try:
        prefill(producer, prompts[-2:])
        assert producer.scheduler.num_held_for_transfer == 2
        drain(producer, consumer, [])
        assert producer.scheduler.num_timed_out_transfers == 2
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_abort_during_the_pull_frees_blocks_on_both_sides(tiny_hf_dir, prompts, expected):
    producer, consumer = pd_pair(tiny_hf_dir, 2, (1, 3), 2, (3, 1))
    try:
        [done] = prefill(producer, [prompts[-1]])
        rid = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=done.kv_transfer_params)
        consumer.step()  # admitted: the pull starts with this plan
        consumer.abort(rid)
        drain(producer, consumer, [])
        assert_idle(producer, consumer)
        # Both keep serving.
        assert [c.token_ids for c in serve_pd(producer, consumer, prompts[-1:], GREEDY)] == expected[-1:]
    finally:
        consumer.close()
        producer.close()


def test_a_request_aborted_before_it_was_scheduled_releases_the_producer(tiny_hf_dir, prompts):
    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 1, ())
    try:
        [done] = prefill(producer, [prompts[-1]])
        rid = consumer.add_request(prompts[-1], GREEDY, kv_transfer_params=done.kv_transfer_params)
        consumer.abort(rid)
        drain(producer, consumer, [])
        assert producer.scheduler.num_timed_out_transfers == 0  # released, not timed out
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_prefill_pp2_decode_pp1_is_token_exact():
    """SmolLM2-135M in bfloat16 where the CPU computes it (the served dtype): a 2-stage prefill
    engine hands chat prompts to a 1-stage decode engine; greedy output equals one engine's."""
    from asyncpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    def config(pp_size: int, **kv) -> EngineConfig:
        base = EngineConfig(
            model=ModelConfig(source="gguf", max_model_len=512),
            parallel=ParallelConfig(pp_size=pp_size, num_threads=1),
            cache=CacheConfig(kv_cache_memory_mb=32),
        )
        return base.replace(kv_transfer=kv) if kv else base

    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly." for i in range(12))
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for q in ("What is the capital of France?", "Name three colors.", "Count to five.")
    ]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    single = Engine(config(1))
    try:
        expected = [c.token_ids for c in single.generate(chats, params)]
    finally:
        single.close()
    producer = Engine(config(2, connector="pd", kv_role="producer", engine_id="prefill"))
    consumer = Engine(config(1, connector="pd", kv_role="consumer", engine_id="decode"))
    try:
        consumer.kv_connector.add_remote_engine(producer.kv_connector.engine_handshake())
        producer.kv_connector.add_remote_engine(consumer.kv_connector.engine_handshake())
        completions = serve_pd(producer, consumer, chats, params)
        assert [c.token_ids for c in completions] == expected
        stats = consumer.kv_connector.stats()
        # The long system prompt is pulled once; the other chats hit it in the decode engine's own
        # prefix cache and release what the prefill engine holds for them.
        assert stats["pd_num_pulled_tokens"] >= 96
        assert stats["pd_num_pulls"] + stats["pd_num_released_unpulled"] == 3
        assert_idle(producer, consumer)
        # Early handover (the router's default), the same chats again: read while they are computed.
        assert [c.token_ids for c in serve_pd_early(producer, consumer, chats, params)] == expected
        assert consumer.kv_connector.stats()["pd_num_early_handovers"] == 3
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_sampled_output_logprobs_and_stop_strings_equal_one_engine(tiny_hf_dir, prompts):
    """The prefill engine's token is the client's first: seeded sampling, logprobs and a stop string
    that begins in that token's text and ends in the decode engine's continue exactly as one engine."""
    single = Engine(tiny_config(tiny_hf_dir))
    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 2, (1, 3))
    try:
        sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, logprobs=2, ignore_eos=True)
        want = single.generate(prompts, sampled)
        got = serve_pd(producer, consumer, prompts, sampled)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.text for c in got] == [c.text for c in want]
        assert [c.logprobs for c in got] == [c.logprobs for c in want]

        plain = single.generate(prompts, GREEDY)
        # A stop string across the first two tokens' text: the prefill engine holds back its start.
        i = next(i for i, c in enumerate(plain) if _spans(single, c.token_ids))
        stop = _spans(single, plain[i].token_ids)
        for include in (False, True):
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
            [want] = single.generate([prompts[i]], params)
            assert want.finish_reason == "stop" and want.stop_reason == stop
            [got] = serve_pd(producer, consumer, [prompts[i]], params)
            assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
                want.text, want.token_ids, want.finish_reason, want.stop_reason
            )
        assert_idle(producer, consumer)
    finally:
        single.close()
        consumer.close()
        producer.close()


def _spans(engine: Engine, token_ids: list[int]) -> str | None:
    """Two characters of the text, the last of the first token's and the first of the second's."""
    first, both = _text(engine, token_ids[:1]), _text(engine, token_ids[:2])
    if first and len(both) > len(first) and both.startswith(first) and "\ufffd" not in both:
        return both[len(first) - 1 : len(first) + 1]
    return None


def _text(engine: Engine, token_ids: list[int]) -> str:
    return engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_a_request_that_stops_at_its_first_token_hands_out_nothing(tiny_hf_dir, prompts, expected):
    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 1, ())
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[expected[0][0]])
        [done] = prefill(producer, prompts[:1], params=params)
        assert (done.finish_reason, done.kv_transfer_params, done.token_ids) == ("stop", None, expected[0][:1])
        assert_idle(producer)  # nothing held: the client's request is over
    finally:
        consumer.close()
        producer.close()


def test_max_tokens_must_leave_something_after_the_prefill_token(tiny_hf_dir, prompts):
    producer, consumer = pd_pair(tiny_hf_dir, 1, (), 1, ())
    try:
        [done] = prefill(producer, prompts[:1])
        with pytest.raises(InvalidRequestError, match="leaves nothing to generate") as info:
            consumer.add_request(prompts[0], SamplingParams(max_tokens=1), kv_transfer_params=done.kv_transfer_params)
        assert info.value.field == "max_tokens"
        stop = _text(consumer, done.token_ids)
        if stop:  # a stop string the prefill's own token completes: the prefill engine would have stopped
            with pytest.raises(InvalidRequestError, match="stop strings"):
                consumer.add_request(prompts[0], SamplingParams(stop=[stop]), kv_transfer_params=done.kv_transfer_params)
        consumer.add_request(prompts[0], GREEDY, kv_transfer_params=done.kv_transfer_params)  # still pullable
        drain(producer, consumer, [])
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()


def test_the_handover_is_timed_per_request(tiny_hf_dir, prompts):
    """From the prefill engine's token to the decode stages having its KV (the latest stage's)."""
    producer, consumer = pd_pair(tiny_hf_dir, 2, (1, 3), 2, (3, 1))
    try:
        serve_pd(producer, consumer, prompts[:3], GREEDY)
        stats = consumer.stats()
        assert stats["kv_num_handovers"] == 3
        assert 0 < stats["kv_handover_s_p50"] <= stats["kv_handover_s_p99"] < 30
        assert producer.stats()["kv_num_handovers"] == 0 and producer.stats()["kv_handover_s_p50"] is None
    finally:
        consumer.close()
        producer.close()


def test_without_nixl_the_engine_does_not_start(tiny_hf_dir, monkeypatch):
    """No nixl-cu12: a clear start-up error naming the key and the extra, not stages dying on an import."""
    from asyncpp.config import ConfigError
    from asyncpp.kv_transfer.pd import scheduler

    monkeypatch.setattr(scheduler, "nixl_available", lambda: False)
    kv = {"connector": "pd", "kv_role": "producer", "engine_id": "prefill"}
    with pytest.raises(ConfigError, match=r"kv_transfer.connector = 'pd'.*asyncpp\[pd\]"):
        Engine(tiny_config(tiny_hf_dir, kv_transfer=kv))


@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
def test_a_stop_string_in_the_first_token_hands_out_nothing(tiny_hf_dir, prompts, expected, pp):
    """The scheduler finishes the prefill at max_tokens 1 and hands out params; the output processor
    then finds a stop string in that token's text. The request is over there, as on one engine: no
    params leave the engine, and the blocks held for them come back at once, not at the timeout."""
    producer, consumer = pd_pair(tiny_hf_dir, pp, (3, 1) if pp == 2 else (), 1, (), kv_transfer={"pull_timeout_s": 60.0})
    try:
        i = next(i for i, ids in enumerate(expected) if _text(producer, ids[:1]).strip())
        stop = _text(producer, expected[i][:1]).strip()
        params = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])
        [done] = prefill(producer, [prompts[i]], params=params)
        assert (done.finish_reason, done.stop_reason, done.kv_transfer_params) == ("stop", stop, None)
        drain(producer, consumer, [])
        assert producer.scheduler.num_timed_out_transfers == 0
        assert_idle(producer, consumer)
        [again] = serve_pd(producer, consumer, [prompts[i]], GREEDY)  # and it serves on
        assert again.token_ids == expected[i]
        assert_idle(producer, consumer)
    finally:
        consumer.close()
        producer.close()
