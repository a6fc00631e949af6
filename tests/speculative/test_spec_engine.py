"""Speculative decoding in the in-process engine: greedy output identical to no drafting, at every
PP size, with the offload connector, stops and max_tokens inside an accepted run, and caches that
hold no unverified token."""

from __future__ import annotations

import pytest

from asyncpp.config import ConfigError, config_from_dict
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.chi_square import p_value
from tests.conftest import tiny_config, tiny_prompts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}


def repetitive_prompts(vocab_size: int, num_prompts: int = 6) -> list[list[int]]:
    """Prompts that repeat a phrase (the n-gram proposer finds drafts there), and plain ones."""
    base = tiny_prompts(vocab_size, num_prompts, seed=1)
    return [p[:8] * 3 + p[8:] if i % 2 == 0 else p for i, p in enumerate(base)]


def run(config, prompts, params=GREEDY):
    engine = Engine(config)
    try:
        results = engine.generate(prompts, params)
        return [r.token_ids for r in results], engine.stats(), engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def prompts(tiny_hf_dir):
    return repetitive_prompts(320)


@pytest.fixture(scope="module")
def reference(tiny_hf_dir, prompts):
    tokens, _, _ = run(tiny_config(tiny_hf_dir), prompts)
    return tokens


@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_greedy_with_drafts_equals_without(tiny_hf_dir, prompts, reference, pp_size):
    config = tiny_config(tiny_hf_dir, parallel={"pp_size": pp_size}, speculative=SPEC)
    tokens, stats, _ = run(config, prompts)
    assert tokens == reference
    # Drafting happened, some drafts were rejected (else the rollback is untested) and some accepted.
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    assert len(stats["spec_decode_num_accepted_tokens_per_pos"]) == SPEC["num_speculative_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]


def test_preemption_rebuilds_the_proposer_and_returns_every_block(tiny_hf_dir, prompts, reference):
    """A preempted request resumes with its proposer state rebuilt from its tokens (vLLM #57817:
    proposer state must not outlive or miss a request); rolled-back blocks all come back."""
    config = tiny_config(tiny_hf_dir, speculative=SPEC, cache={"num_kv_blocks_override": 16})
    tokens, stats, engine = run(config, prompts)
    assert tokens == reference
    assert stats["num_preemptions"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    last = engine.executor.runners[-1]  # its state follows the runner's per-request state (dropped
    assert last.proposer.num_requests == len(last.sampling_states) <= 1  # with the next plan's finished ids)


def test_prefix_cache_hashes_hold_no_draft(tiny_hf_dir, prompts, reference):
    """Block hashes after a run with many rejected drafts equal those of a run without drafts."""

    def hashes(config):
        engine = Engine(config)
        try:
            ids = [engine.add_request(p, GREEDY) for p in prompts]
            seen = {}
            while engine.has_unfinished_requests():
                engine.step()
                for rid in ids:
                    if engine.block_manager.has_blocks(rid):
                        seen[rid] = list(engine.block_manager.block_hashes(rid))
            return seen, engine.stats()
        finally:
            engine.close()

    plain, _ = hashes(tiny_config(tiny_hf_dir))
    spec, stats = hashes(tiny_config(tiny_hf_dir, speculative=SPEC))
    assert stats["spec_decode_num_draft_tokens"] - stats["spec_decode_num_accepted_tokens"] > 10
    for rid, spec_hashes in spec.items():
        # Both runs hashed the same known tokens; a request's last table may differ in length only
        # by where its final step ended.
        n = min(len(spec_hashes), len(plain[rid]))
        assert spec_hashes[:n] == plain[rid][:n]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11])
def test_max_tokens_inside_an_accepted_run(tiny_hf_dir, prompts, reference, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, _, _ = run(tiny_config(tiny_hf_dir, speculative=SPEC), prompts, params)
    assert tokens == [r[:max_tokens] for r in reference]


def test_stop_token_inside_an_accepted_run(tiny_hf_dir, prompts, reference):
    # Stop at the 7th output token of each request: inside the runs drafts bring.
    outs = []
    for prompt, ref in zip(prompts, reference):
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[6]])
        tokens, _, _ = run(tiny_config(tiny_hf_dir, speculative=SPEC), [prompt], params)
        outs.append(tokens[0])
    assert outs == [ref[: ref.index(ref[6]) + 1] for ref in reference]


@pytest.mark.parametrize(
    "values,key",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative.prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 600}, "speculative.num_speculative_tokens"),
    ],
)
def test_bad_configuration_names_the_field(values, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"speculative": values})


def test_unknown_method_fails_at_start_up(tiny_hf_dir):
    with pytest.raises(ConfigError, match=r"speculative\.method"):
        Engine(tiny_config(tiny_hf_dir, speculative={"method": "medusa"}))


def test_stop_string_inside_an_accepted_run(tiny_hf_dir, prompts):
    """A stop string completed by a token in the middle of a step's accepted run ends the request
    there: text, tokens and finish reason as without drafts, nothing past it."""
    plain = Engine(tiny_config(tiny_hf_dir))
    spec = Engine(tiny_config(tiny_hf_dir, speculative=SPEC))
    try:
        texts = [r.text for r in plain.generate(prompts, GREEDY)]
        checked = 0
        for prompt, text in zip(prompts, texts):
            stop = text[12:14]  # two characters well inside the answer
            if not stop.strip() or stop in text[:12]:
                continue
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
            want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
            checked += 1
        assert checked >= 3
        assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        plain.close()
        spec.close()


def test_penalties_and_logprobs_with_several_tokens_per_step(tiny_hf_dir, prompts):
    """Greedy with penalties is unchanged by drafting (row j sees the drafts before it), and each
    token's logprobs are those of its own row."""
    params = SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2, logprobs=3
    )
    plain_tokens, _, _ = run(tiny_config(tiny_hf_dir), prompts, params)
    plain = Engine(tiny_config(tiny_hf_dir))
    spec = Engine(tiny_config(tiny_hf_dir, speculative=SPEC))
    try:
        want = plain.generate(prompts, params)
        got = spec.generate(prompts, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want] == plain_tokens
        for a, b in zip(got, want):
            assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.top_token_ids == y.top_token_ids
                assert x.token_logprob == pytest.approx(y.token_logprob, abs=1e-5)
        assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        plain.close()
        spec.close()


def test_seeded_sampling_with_drafts_is_reproducible(tiny_hf_dir, prompts):
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    first, stats, _ = run(tiny_config(tiny_hf_dir, speculative=SPEC), prompts, params)
    again, _, _ = run(tiny_config(tiny_hf_dir, speculative=SPEC), prompts[::-1], params[::-1])
    assert first == again[::-1]
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_random_sampling_with_drafts_keeps_the_distribution(tiny_hf_dir):
    """Chi-square, two samples: the first three sampled tokens (each drawn after drafts were
    verified against it) have the same distribution with drafts as without."""
    # The model's own greedy continuation, which loops: its likely tokens are in the prompt, so the
    # proposer drafts from the first step on and many drafts are accepted.
    seed_prompt = tiny_prompts(320, 1, seed=3)[0]
    loop, _, _ = run(tiny_config(tiny_hf_dir), [seed_prompt], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    prompt = seed_prompt + loop[0]
    n = 600

    def counts(speculative):
        sections = {"speculative": speculative} if speculative else {}
        params = [SamplingParams(max_tokens=3, temperature=1.5, top_k=4, seed=i, ignore_eos=True) for i in range(n)]
        tokens, stats, _ = run(tiny_config(tiny_hf_dir, scheduler={"max_num_seqs": 128}, **sections), [prompt] * n, params)
        hist = {}
        for t in tokens:
            hist[tuple(t[1:3])] = hist.get(tuple(t[1:3]), 0) + 1
        return hist, stats

    plain, _ = counts(None)
    spec, stats = counts(SPEC)
    assert stats["spec_decode_num_drafts"] > n // 2  # many draws came through a verification
    assert stats["spec_decode_num_accepted_tokens"] > 0
    # Pool the rare outcomes, then a chi-square test of homogeneity at the 0.001 level.
    keys = sorted(set(plain) | set(spec), key=lambda k: -(plain.get(k, 0) + spec.get(k, 0)))
    cells, rest = [], [0, 0]
    for k in keys:
        a, b = plain.get(k, 0), spec.get(k, 0)
        if a + b >= 20:
            cells.append((a, b))
        else:
            rest[0] += a
            rest[1] += b
    if sum(rest) >= 20:
        cells.append(tuple(rest))
    assert len(cells) >= 3
    stat = 0.0
    for a, b in cells:
        expected = (a + b) / 2  # equal sample sizes
        stat += (a - expected) ** 2 / expected + (b - expected) ** 2 / expected
    assert p_value(stat, df=len(cells) - 1) > 0.001, (stat, cells)
