"""Logprobs: raw log-softmax (before penalties and temperature), trimmed per request."""

import torch

from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import RequestSamplingState, Sampler

VOCAB_SIZE = 100


def test_logprobs_are_raw_and_trimmed_per_request() -> None:
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, repetition_penalty=1.5, frequency_penalty=1.0, logprobs=3),
        SamplingParams(temperature=1.0),  # did not ask
        SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0),
        SamplingParams(temperature=1.2, top_k=10, seed=3, logprobs=20),
        SamplingParams(temperature=0.0),  # did not ask
    ]
    logits = torch.randn(len(params), VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 2
    # Penalise each row's most likely tokens so raw and penalised logprobs clearly differ.
    top_ids = logits.topk(3, dim=-1).indices.tolist()
    states = [RequestSamplingState.create(p, top_ids[i], top_ids[i][:1]) for i, p in enumerate(params)]
    out = Sampler(VOCAB_SIZE)(logits, states)

    raw = logits.log_softmax(dim=-1)
    tokens, per_request = out.to_lists()
    for i, p in enumerate(params):
        lp = out.request_logprobs(i)
        assert lp == per_request[i]
        if p.logprobs is None:
            assert lp is None
            continue
        torch.testing.assert_close(torch.tensor(lp.sampled_logprob), raw[i, tokens[i]])
        expected = raw[i].topk(p.logprobs)
        assert lp.top_token_ids == expected.indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), expected.values)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert out.request_logprobs(3).top_token_ids == []  # logprobs=0: only the sampled token's
    assert out.top_logprobs.shape == (len(params), 20)


def test_no_logprobs_unless_asked() -> None:
    states = [RequestSamplingState.create(SamplingParams(temperature=t), [], []) for t in (0.0, 1.0)]
    out = Sampler(VOCAB_SIZE)(torch.randn(2, VOCAB_SIZE), states)
    assert out.logprobs is None and out.top_logprob_token_ids is None
    assert out.request_logprobs(0) is None
    assert out.to_lists()[1] == [None, None]


def test_only_sampled_logprob_when_all_ask_zero() -> None:
    logits = torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(1))
    states = [RequestSamplingState.create(SamplingParams(temperature=0.0, logprobs=0), [], []) for _ in range(3)]
    out = Sampler(VOCAB_SIZE)(logits, states)
    assert out.top_logprobs.shape == (3, 0)
    expected = logits.log_softmax(dim=-1).gather(1, logits.argmax(dim=-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert [out.request_logprobs(i).top_logprobs for i in range(3)] == [[], [], []]
