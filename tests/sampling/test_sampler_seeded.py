"""Seeded requests: samples depend only on the seed, the step and the logits."""

import torch

from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import RequestSamplingState, Sampler

VOCAB_SIZE = 64
NUM_STEPS = 20
TARGET_LOGITS = torch.randn(VOCAB_SIZE, generator=torch.Generator().manual_seed(7))  # [vocab_size]
TARGET = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.3, seed=1234)
NEIGHBOURS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=5, seed=7),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1),
    SamplingParams(temperature=0.6, repetition_penalty=1.3, seed=99),
    SamplingParams(temperature=1.5, top_k=20),
    SamplingParams(temperature=1.0, presence_penalty=0.5, seed=5, logprobs=3),
]


def _run_target(
    target_params: SamplingParams,
    row: int,
    neighbours: list[SamplingParams],
    global_seed: int,
    num_steps: int = NUM_STEPS,
    target: RequestSamplingState | None = None,
) -> list[int]:
    """Sample `num_steps` times with the target at `row`; returns the target's new tokens."""
    sampler = Sampler(VOCAB_SIZE)
    if target is None:
        target = RequestSamplingState.create(target_params, [1, 2, 3], [])
    others = [RequestSamplingState.create(p, [5, 6], []) for p in neighbours]
    tokens = []
    with torch.random.fork_rng():
        torch.manual_seed(global_seed)
        for _ in range(num_steps):
            states = others[:row] + [target] + others[row:]
            logits = torch.randn(len(states), VOCAB_SIZE)  # neighbours see fresh noise each step
            logits[row] = TARGET_LOGITS
            sampled = sampler(logits, states).sampled_token_ids.tolist()
            for state, token_id in zip(states, sampled):
                state.output_token_ids.append(token_id)  # what the runner does
            tokens.append(sampled[row])
    return tokens


def test_same_tokens_alone_or_anywhere_in_a_batch() -> None:
    alone = _run_target(TARGET, 0, [], global_seed=0)
    middle = _run_target(TARGET, 5, NEIGHBOURS, global_seed=1)
    first = _run_target(TARGET, 0, NEIGHBOURS[::-1], global_seed=2)
    last = _run_target(TARGET, len(NEIGHBOURS), NEIGHBOURS, global_seed=3)
    assert alone == middle == first == last
    assert len(set(alone)) > 3  # the target really samples


def test_seeded_request_varies_across_steps() -> None:
    # Fixed logits and no penalties: only a fresh draw per step makes the tokens vary.
    tokens = _run_target(SamplingParams(temperature=1.0, seed=3), 0, [], global_seed=0)
    assert len(set(tokens)) > 3


def test_different_seeds_give_different_tokens() -> None:
    tokens_a = _run_target(TARGET, 0, [], global_seed=0)
    tokens_b = _run_target(SamplingParams(**{**TARGET.to_dict(), "seed": 4321}), 0, [], global_seed=0)
    assert tokens_a != tokens_b


def test_unseeded_requests_follow_the_global_rng() -> None:
    unseeded = SamplingParams(temperature=1.0)
    assert _run_target(unseeded, 0, [], global_seed=0) == _run_target(unseeded, 0, [], global_seed=0)
    assert _run_target(unseeded, 0, [], global_seed=0) != _run_target(unseeded, 0, [], global_seed=1)


def test_rebuilt_state_continues_the_same_sequence() -> None:
    # After a preemption the runner rebuilds the state with the tokens so far.
    full = _run_target(TARGET, 0, [], global_seed=0)
    head = full[: NUM_STEPS // 2]
    rebuilt = RequestSamplingState.create(TARGET, [1, 2, 3], head)
    tail = _run_target(TARGET, 2, NEIGHBOURS[:4], global_seed=9, num_steps=NUM_STEPS - len(head), target=rebuilt)
    assert head + tail == full
