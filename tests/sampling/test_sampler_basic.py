"""Sampler basics: greedy, top-k=1, no-op top-k, dtypes, shapes, input left untouched."""

import pytest
import torch

from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import RequestSamplingState, Sampler


def _states(params: list[SamplingParams]) -> list[RequestSamplingState]:
    return [RequestSamplingState.create(p, [], []) for p in params]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax() -> None:
    logits = _randn(64, 100)
    out = Sampler(100)(logits, _states([SamplingParams(temperature=0.0)] * 64))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.device.type == "cpu"
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_one_equals_greedy_in_a_mixed_batch() -> None:
    num_rows = 300
    logits = _randn(num_rows, 500, seed=1) * 3
    params = []
    for i in range(num_rows):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=1.0, top_k=1))
        else:
            params.append(SamplingParams(temperature=1.0, top_k=1, seed=i, top_p=0.9))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = Sampler(500)(logits, _states(params))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_at_or_past_vocab_is_a_noop() -> None:
    vocab_size = 16
    logits = _randn(vocab_size, seed=2)
    top_ks = [0, -1, vocab_size, vocab_size + 1, 10**6]
    sampler = Sampler(vocab_size)
    firsts = []
    for seed in range(30):
        # Same seed and step => same exponentials, so the rows differ only by top_k.
        states = _states([SamplingParams(top_k=k, seed=seed) for k in top_ks])
        tokens = sampler(logits.expand(len(top_ks), vocab_size), states).sampled_token_ids
        assert torch.all(tokens == tokens[0]), (seed, tokens)
        firsts.append(int(tokens[0]))
    assert len(set(firsts)) > 3  # really sampling, not collapsing to one token


def test_bf16_logits() -> None:
    vocab_size = 50
    logits = (_randn(8, vocab_size, seed=3) * 4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 4 + [SamplingParams(top_p=0.8, seed=1, logprobs=1)] * 4
    out = Sampler(vocab_size)(logits, _states(params))
    expected_logprobs = logits.float().log_softmax(dim=-1)
    tokens = out.sampled_token_ids
    assert torch.equal(tokens[:4], logits.float()[:4].argmax(dim=-1))
    assert bool(((tokens >= 0) & (tokens < vocab_size)).all())
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1))


def test_input_logits_are_not_modified() -> None:
    logits = _randn(5, 40, seed=4)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, seed=3),
        SamplingParams(temperature=1.3, presence_penalty=1.0),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    states = [RequestSamplingState.create(p, [1, 2, 3], [4, 4, 5]) for p in params]
    Sampler(40)(logits, states)
    assert torch.equal(logits, before)


def test_rejects_logits_of_the_wrong_shape() -> None:
    sampler = Sampler(10)
    with pytest.raises(ValueError, match="vocab_size=10"):
        sampler(torch.zeros(2, 11), _states([SamplingParams()] * 2))
    with pytest.raises(ValueError, match="num_reqs=1"):
        sampler(torch.zeros(2, 10), _states([SamplingParams()]))


def test_empty_batch() -> None:
    out = Sampler(10)(torch.zeros(0, 10), [])
    assert out.sampled_token_ids.shape == (0,)
    assert out.to_lists() == ([], [])
