"""Penalties against a plain per-row Python reference."""

import torch

from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.penalties import apply_penalties
from asyncpp.sampling.sampler import RequestSamplingState, Sampler

VOCAB_SIZE = 30


def _reference(row: list[float], prompt: list[int], output: list[int], params: SamplingParams) -> list[float]:
    result = list(row)
    for token_id in set(prompt) | set(output):
        if result[token_id] > 0:
            result[token_id] /= params.repetition_penalty
        else:
            result[token_id] *= params.repetition_penalty
    for token_id in set(output):
        result[token_id] -= params.frequency_penalty * output.count(token_id) + params.presence_penalty
    return result


CASES = [
    # (params, prompt token ids, output token ids)
    (SamplingParams(repetition_penalty=1.5), [0, 1, 2, 2, 9], [3, 3, 4]),
    (SamplingParams(repetition_penalty=0.7), [5, 6], []),
    (SamplingParams(), [0, 1, 2], [0, 1, 2]),  # no penalties: untouched
    (SamplingParams(presence_penalty=1.2), [7, 8], [1, 1, 1, 7]),
    (SamplingParams(frequency_penalty=0.8), [], [2, 2, 5, 2, 29]),
    (SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0), [3], [3, 4, 4]),
    (SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), [10, 11], [11, 12, 12, 12]),
    (SamplingParams(repetition_penalty=1.3, temperature=0.0), [], []),  # nothing seen yet
]


def _logits(num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 3


def _states() -> list[RequestSamplingState]:
    return [RequestSamplingState.create(p, prompt, output) for p, prompt, output in CASES]


def test_penalties_match_reference() -> None:
    logits = _logits(len(CASES))
    before = logits.clone()
    penalized = apply_penalties(logits, _states())
    expected = torch.tensor(
        [_reference(logits[i].tolist(), prompt, output, p) for i, (p, prompt, output) in enumerate(CASES)]
    )
    torch.testing.assert_close(penalized, expected)
    assert torch.equal(logits, before)
    assert torch.equal(penalized[2], logits[2])  # bit-identical when the row has no penalties
    assert not torch.equal(penalized, logits)


def test_no_penalties_returns_the_input() -> None:
    logits = _logits(2)
    states = [RequestSamplingState.create(SamplingParams(), [1], [2])] * 2
    assert apply_penalties(logits, states) is logits


def test_greedy_sampling_uses_penalised_logits() -> None:
    num_rows = 40
    logits = _logits(num_rows)
    raw_argmax = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3)
    # Every row has already produced its top token twice, so penalties can move the argmax.
    states = [RequestSamplingState.create(params, [i % VOCAB_SIZE], [raw_argmax[i]] * 2) for i in range(num_rows)]
    sampled = Sampler(VOCAB_SIZE)(logits, states).sampled_token_ids.tolist()
    expected = [
        max(
            range(VOCAB_SIZE),
            key=_reference(logits[i].tolist(), s.prompt_token_ids, s.output_token_ids, params).__getitem__,
        )
        for i, s in enumerate(states)
    ]
    assert sampled == expected
    assert sampled != raw_argmax
