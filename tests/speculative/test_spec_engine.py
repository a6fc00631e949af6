"""Speculative decoding in the in-process engine: greedy output identical to no drafting, at every
PP size, with the offload connector, stops and max_tokens inside an accepted run, and caches that
hold no unverified token."""

from __future__ import annotations

import pytest

from asyncpp.config import ConfigError, config_from_dict
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
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


def test_every_block_is_returned(tiny_hf_dir, prompts, reference):
    config = tiny_config(tiny_hf_dir, speculative=SPEC, cache={"num_kv_blocks_override": 24})
    tokens, _, engine = run(config, prompts)
    assert tokens == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


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
