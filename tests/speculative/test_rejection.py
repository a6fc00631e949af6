"""`RejectionSampler`: greedy equals token-by-token greedy, seeded equals token-by-token sampling, random
keeps the target distribution.

The distribution tests are seeded, so each is deterministic: a correct sampler
fails the p = 0.001 threshold only for an unlucky fixed seed, a wrong one by miles.
"""

import dataclasses

import pytest
import torch

from asyncpp.sampling.params import SamplingParams
from asyncpp.sampling.sampler import RequestSamplingState, Sampler
from asyncpp.speculative.rejection import RejectionSampler, VerifiedTokens
from asyncpp.worker.outputs import Logprobs
from tests.chi_square import chi_square as _chi_square
from tests.chi_square import p_value as _p_value

PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])  # [vocab_size]
LOGITS = PROBS.log() + 1.5  # logits are only defined up to a shift
# The distribution after the first draft: deliberately unlike PROBS.
NEXT_PROBS = torch.tensor([0.05, 0.10, 0.35, 0.05, 0.20, 0.05, 0.15, 0.05])
NEXT_LOGITS = NEXT_PROBS.log() - 0.5
VOCAB_SIZE = PROBS.numel()
CHI2_CRITICAL_P001 = {7: 24.32, 14: 36.12}
NUM_DRAWS = 8000


def _state(params: SamplingParams, output: list[int] | None = None) -> RequestSamplingState:
    return RequestSamplingState.create(params, [1, 2], output or [])


def _verify(logits: torch.Tensor, states, drafts, vocab_size: int = VOCAB_SIZE) -> VerifiedTokens:
    return RejectionSampler(Sampler(vocab_size))(logits, states, drafts)




def test_p_value_matches_the_table() -> None:
    for df, critical in CHI2_CRITICAL_P001.items():
        assert _p_value(critical, df) == pytest.approx(0.001, rel=1e-2)


# --- no drafts: exactly the plain sampler ---------------------------------------------------------

NO_DRAFT_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.4, logprobs=3),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, frequency_penalty=0.5, seed=3, logprobs=0),
    SamplingParams(temperature=1.2, min_p=0.05, presence_penalty=0.7, logprobs=5),
]


@pytest.mark.parametrize("params", [NO_DRAFT_PARAMS, NO_DRAFT_PARAMS[:1], NO_DRAFT_PARAMS[2:3]])
def test_no_drafts_equals_sampler(params: list[SamplingParams]) -> None:
    vocab_size = 64
    logits = torch.randn(len(params), vocab_size, generator=torch.Generator().manual_seed(1))
    outputs = [[3, 7, 3], [], [9], [1, 1], [4, 5, 6], [8]]
    for step in range(5):  # several steps: seeded rows move on, the global RNG advances
        states = [_state(p, outputs[i]) for i, p in enumerate(params)]
        with torch.random.fork_rng():
            torch.manual_seed(step)
            expected = Sampler(vocab_size)(logits, states)
        with torch.random.fork_rng():
            torch.manual_seed(step)
            got = _verify(logits, states, [[] for _ in params], vocab_size)
        token_ids, request_logprobs = expected.to_lists()
        assert got.token_ids == [[t] for t in token_ids]
        assert got.num_draft_tokens == [0] * len(params) and got.num_accepted == [0] * len(params)
        for lp, got_lp in zip(request_logprobs, got.logprobs):
            if lp is None:
                assert got_lp is None
            else:
                assert got_lp == [Logprobs(lp.sampled_logprob, lp.top_token_ids, lp.top_logprobs)]
        for i in range(len(params)):
            outputs[i] = outputs[i] + [token_ids[i]]


def test_a_request_without_drafts_samples_as_plain_sampler_beside_drafted_ones() -> None:
    # A seeded request without drafts gets the Sampler's token even when its neighbours have drafts.
    vocab_size = 64
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.3, seed=77)
    for step in range(10):
        row = torch.randn(1, vocab_size, generator=gen)
        output = list(range(step))
        expected = Sampler(vocab_size)(row, [_state(params, output)]).token_id(0)
        neighbour = _state(SamplingParams(temperature=1.0, seed=5))
        logits = torch.cat([torch.randn(3, vocab_size, generator=gen), row])
        got = _verify(logits, [neighbour, _state(params, output)], [[1, 2], []], vocab_size)
        assert got.token_ids[1] == [expected]


# --- greedy -----------------------------------------------------------------------------------------


def _rows_with_argmax(argmaxes: list[int], vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab_size)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("drafts", "expected"),
    [
        ([3, 5, 1], [3, 5, 1, 6]),  # all accepted, then the bonus token from the last row
        ([3, 4, 1], [3, 5]),  # first mismatch at row 1: its target token ends the output
        ([2, 5, 1], [3]),  # mismatch at row 0
    ],
)
def test_greedy_accepts_the_matching_prefix(drafts: list[int], expected: list[int]) -> None:
    logits = _rows_with_argmax([3, 5, 1, 6])
    out = _verify(logits, [_state(SamplingParams(temperature=0.0))], [drafts])
    assert out.token_ids == [expected]
    assert out.num_draft_tokens == [3] and out.num_accepted == [len(expected) - 1]


def test_greedy_with_a_random_neighbour_and_rows_after_it() -> None:
    # Row bookkeeping across requests: each request reads only its own rows.
    logits = torch.cat([_rows_with_argmax([4, 4]), LOGITS.expand(3, VOCAB_SIZE), _rows_with_argmax([2, 7, 0])])
    states = [
        _state(SamplingParams(temperature=0.0)),
        _state(SamplingParams(temperature=1.0, seed=1)),
        _state(SamplingParams(temperature=0.0, logprobs=1)),
    ]
    out = _verify(logits, states, [[4], [0, 1], [2, 7]])
    assert out.token_ids[0] == [4, 4] and out.token_ids[2] == [2, 7, 0]
    assert out.num_accepted[0] == 1 and out.num_accepted[2] == 2


class TinyModel:
    """Logits as a fixed function of the last token: next-token logits = table[last]."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.table = torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(seed))

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return self.table[tokens[-1]]


def test_greedy_equals_token_by_token_greedy_with_penalties() -> None:
    vocab_size, num_tokens = 16, 40
    model = TinyModel(vocab_size, seed=4)
    # Penalties make the argmax depend on the whole output, drafts included.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0)
    prompt = [1, 2]

    reference: list[int] = []
    sampler = Sampler(vocab_size)
    while len(reference) < num_tokens:
        state = RequestSamplingState.create(params, prompt, reference)
        reference.append(sampler(model.logits(prompt + reference).unsqueeze(0), [state]).token_id(0))

    rejection = RejectionSampler(sampler)
    draft_rng = torch.Generator().manual_seed(0)
    output: list[int] = []
    total_accepted = total_rejected = 0
    while len(output) < num_tokens:
        # Drafts: the right continuation with random corruptions, 0-4 of them.
        num_drafts = int(torch.randint(0, 5, (1,), generator=draft_rng))
        drafts = reference[len(output) : len(output) + num_drafts]
        drafts = [t if torch.rand(1, generator=draft_rng) < 0.7 else (t + 1) % vocab_size for t in drafts]
        context = prompt + output
        logits = torch.stack([model.logits(context + drafts[:j]) for j in range(len(drafts) + 1)])
        state = RequestSamplingState.create(params, prompt, output)
        out = rejection(logits, [state], [drafts])
        assert state.output_token_ids == output  # the state is left alone
        total_accepted += out.num_accepted[0]
        total_rejected += int(out.num_accepted[0] < len(drafts))
        output += out.token_ids[0]
    assert output[:num_tokens] == reference
    assert total_accepted > 5 and total_rejected > 5  # both paths exercised


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_tokens_are_token_by_token_sampling_whatever_the_drafts(seed: int) -> None:
    # Where drafts are verified changes with timing (async scheduling, a restart): a seeded
    # request's tokens must not. Drafts: the right continuation, corrupted, or junk (token 0).
    vocab_size, num_tokens = 16, 40
    model = TinyModel(vocab_size, seed=4)
    params = SamplingParams(temperature=1.2, top_p=0.95, frequency_penalty=0.5, seed=seed)
    prompt = [1, 2]
    reference: list[int] = []
    sampler = Sampler(vocab_size)
    while len(reference) < num_tokens:
        state = RequestSamplingState.create(params, prompt, reference)
        reference.append(sampler(model.logits(prompt + reference).unsqueeze(0), [state]).token_id(0))
    assert len(set(reference)) > 4  # random enough that a drawn token could differ

    rejection = RejectionSampler(sampler)
    draft_rng = torch.Generator().manual_seed(seed)
    output: list[int] = []
    total_accepted = total_rejected = 0
    while len(output) < num_tokens:
        num_drafts = int(torch.randint(0, 5, (1,), generator=draft_rng))
        drafts = reference[len(output) : len(output) + num_drafts]
        drafts = [t if torch.rand(1, generator=draft_rng) < 0.6 else int(torch.randint(0, 2, (1,), generator=draft_rng)) for t in drafts]
        context = prompt + output
        logits = torch.stack([model.logits(context + drafts[:j]) for j in range(len(drafts) + 1)])
        neighbour = RequestSamplingState.create(SamplingParams(temperature=1.0), [3], [])  # unseeded, same batch
        out = rejection(
            torch.cat([torch.randn(2, vocab_size), logits]), [neighbour, RequestSamplingState.create(params, prompt, output)],
            [[5], drafts],
        )  # fmt: skip
        total_accepted += out.num_accepted[1]
        total_rejected += int(out.num_accepted[1] < len(drafts))
        output += out.token_ids[1]
    assert output[:num_tokens] == reference
    assert total_accepted > 5 and total_rejected > 5  # both paths exercised


@pytest.mark.parametrize(
    "base", [SamplingParams(temperature=0.9), SamplingParams(top_k=20, frequency_penalty=1.5, presence_penalty=0.5)]
)
def test_seeded_bonus_token_is_the_sampler_token_after_the_drafts(base: SamplingParams) -> None:
    # Drafts holding all the mass are always accepted; the bonus row is then sampled exactly as
    # Sampler samples the next step: penalties see the drafts, the step seed counts them.
    vocab_size, drafts = 32, [3, 9]
    gen = torch.Generator().manual_seed(5)
    for seed in range(20):
        params = dataclasses.replace(base, seed=seed)
        certain = torch.full((len(drafts), vocab_size), -200.0)
        certain[torch.arange(len(drafts)), torch.tensor(drafts)] = 0.0
        bonus = torch.randn(1, vocab_size, generator=gen)
        out = _verify(torch.cat([certain, bonus]), [_state(params, [4])], [drafts], vocab_size)
        expected = Sampler(vocab_size)(bonus, [_state(params, [4] + drafts)]).token_id(0)
        assert out.token_ids == [drafts + [expected]]


# --- random: the target distribution -----------------------------------------------------------------


def _first_tokens(params: SamplingParams, drafts: list[int], row_logits: list[torch.Tensor], seeded: bool):
    """Verify NUM_DRAWS copies of one request in one batch; returns the outputs."""
    states = [
        _state(dataclasses.replace(params, seed=s) if seeded else params, [5]) for s in range(NUM_DRAWS)
    ]
    logits = torch.stack(row_logits).repeat(NUM_DRAWS, 1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _verify(logits, states, [drafts] * NUM_DRAWS).token_ids


# (params, draft, tokens that survive the filters): worked out by hand from PROBS, as in tests/sampling.
FIRST_TOKEN_CASES = [
    (SamplingParams(), 1, list(range(VOCAB_SIZE))),
    (SamplingParams(), 0, list(range(VOCAB_SIZE))),
    (SamplingParams(temperature=0.7), 6, list(range(VOCAB_SIZE))),
    (SamplingParams(temperature=0.5, top_p=0.8), 2, [0, 1, 2]),  # probs ~ PROBS**2: .47 .25 .13
    (SamplingParams(top_k=4), 5, [0, 1, 2, 3]),  # the draft is filtered out: never accepted
    (SamplingParams(top_k=5, top_p=0.7, min_p=0.1), 1, [0, 1, 2]),
]


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize(("params", "draft", "kept"), FIRST_TOKEN_CASES)
def test_first_token_follows_the_target(params: SamplingParams, draft: int, kept: list[int], seeded: bool) -> None:
    outputs = _first_tokens(params, [draft], [LOGITS, NEXT_LOGITS], seeded)
    first = torch.tensor([tokens[0] for tokens in outputs])
    counts = torch.bincount(first, minlength=VOCAB_SIZE)
    is_dropped = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    is_dropped[kept] = False
    assert int(counts[is_dropped].sum()) == 0, counts
    expected = torch.softmax(LOGITS[kept] / params.temperature, dim=-1)
    assert _p_value(_chi_square(counts[kept], expected), df=len(kept) - 1) > 0.001, counts
    # The output continues exactly when the draft was accepted.
    assert all((len(tokens) == 2) == (tokens[0] == draft) for tokens in outputs)


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.8, presence_penalty=1.0, frequency_penalty=0.5)]
)
def test_first_two_tokens_follow_the_target_conditionals(params: SamplingParams, seeded: bool) -> None:
    drafts = [1, 2]
    third_logits = torch.zeros(VOCAB_SIZE)
    outputs = _first_tokens(params, drafts, [LOGITS, NEXT_LOGITS, third_logits], seeded)

    # Outcomes: a first token other than d_1 alone (it ends the output), or (d_1, second token).
    def penalized(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(output), minlength=VOCAB_SIZE).float()
        return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()

    p0 = torch.softmax(penalized(LOGITS, [5]) / params.temperature, dim=-1)
    p1 = torch.softmax(penalized(NEXT_LOGITS, [5, drafts[0]]) / params.temperature, dim=-1)
    others = [t for t in range(VOCAB_SIZE) if t != drafts[0]]
    expected = torch.cat([p0[others], p0[drafts[0]] * p1])  # [15]
    counts = torch.zeros(len(others) + VOCAB_SIZE, dtype=torch.int64)
    for tokens in outputs:
        if tokens[0] != drafts[0]:
            counts[others.index(tokens[0])] += 1
        else:
            counts[len(others) + tokens[1]] += 1
    statistic = _chi_square(counts, expected)
    assert statistic < CHI2_CRITICAL_P001[14], (counts, expected * NUM_DRAWS)


# --- seeded reproducibility -----------------------------------------------------------------------------


def test_seeded_tokens_depend_only_on_seed_and_logits() -> None:
    vocab_size = 32
    gen = torch.Generator().manual_seed(9)
    target_logits = torch.randn(4, vocab_size, generator=gen) * 0.3  # flat-ish: draws vary with the seed
    drafts = [5, 6, 7]
    target_logits[torch.arange(3), torch.tensor(drafts)] += 3.5  # each draft accepted about half the time
    neighbours = [
        (SamplingParams(temperature=1.0), [1]),
        (SamplingParams(temperature=0.0), [2, 3]),
        (SamplingParams(temperature=0.8, top_k=5, seed=7), []),
    ]
    results = {}
    for seed in range(30):
        params = SamplingParams(temperature=1.0, top_p=0.95, frequency_penalty=0.2, seed=seed)
        alone = _verify(target_logits, [_state(params, [4])], [drafts], vocab_size).token_ids[0]
        others = [_state(p) for p, _ in neighbours]
        other_logits = [torch.randn(1 + len(d), vocab_size, generator=gen) for _, d in neighbours]
        with torch.random.fork_rng():
            torch.manual_seed(seed + 100)
            batched = _verify(
                torch.cat([other_logits[0], other_logits[1], target_logits, other_logits[2]]),
                [others[0], others[1], _state(params, [4]), others[2]],
                [neighbours[0][1], neighbours[1][1], drafts, neighbours[2][1]],
                vocab_size,
            ).token_ids[2]
        assert batched == alone
        results[seed] = tuple(alone)
    assert len(set(results.values())) > 5  # the seed matters, so the equality above means something


# --- logprobs ---------------------------------------------------------------------------------------------


def test_each_output_token_gets_the_logprobs_of_its_own_row() -> None:
    vocab_size = 16
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(3))
    targets = logits.argmax(dim=-1).tolist()
    # Penalties on: logprobs are still the raw log-softmax, before them.
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.0001)
    extra = torch.randn(1, vocab_size)
    out = _verify(
        torch.cat([logits, extra]),
        [_state(params), _state(SamplingParams(temperature=0.0))],
        [targets[:2], []],
        vocab_size,
    )
    assert out.token_ids[0] == targets and out.logprobs[1] is None
    raw = logits.log_softmax(dim=-1)
    for i, (token, lp) in enumerate(zip(targets, out.logprobs[0])):
        top = raw[i].topk(2)
        assert lp == Logprobs(float(raw[i, token]), top.indices.tolist(), top.values.tolist())


def test_logprobs_of_a_rejection_come_from_the_rejecting_row() -> None:
    logits = torch.stack([LOGITS, NEXT_LOGITS, torch.zeros(VOCAB_SIZE)])
    out = _verify(logits, [_state(SamplingParams(temperature=1.0, seed=0, logprobs=0))], [[0, 3]])
    raw = logits.log_softmax(dim=-1)
    tokens, lps = out.token_ids[0], out.logprobs[0]
    assert len(lps) == len(tokens)
    for i, (token, lp) in enumerate(zip(tokens, lps)):
        assert lp == Logprobs(float(raw[i, token]), [], [])


# --- validation ---------------------------------------------------------------------------------------------


def test_wrong_number_of_rows_names_the_counts() -> None:
    states = [_state(SamplingParams()), _state(SamplingParams())]
    with pytest.raises(ValueError, match=r"num_rows=5.*got \[4, 8\]"):
        _verify(torch.zeros(4, VOCAB_SIZE), states, [[1, 2], [3]])
    with pytest.raises(ValueError, match="1 draft lists for 2 requests"):
        _verify(torch.zeros(3, VOCAB_SIZE), states, [[1, 2]])
    with pytest.raises(ValueError, match="draft token 8"):
        _verify(torch.zeros(3, VOCAB_SIZE), states[:1], [[1, 8]])
