"""`StructuredSampling`: the sampling stage's matchers mask exactly what their grammar forbids, row by
row for drafts (consumed for the masks, then rolled back), and follow the tokens sampled."""

from __future__ import annotations

import torch

from asyncpp.sampling.structured import StructuredOutputs
from asyncpp.structured.sampling import StructuredSampling

CHOICE = StructuredOutputs.from_dict({"choice": ["abc", "abd", "b"]})
NEG_INF = float("-inf")


def sampling(compiler) -> StructuredSampling:
    made = []

    def make():
        made.append(1)
        return compiler

    structured = StructuredSampling(make)
    assert made == []  # nothing loaded until a request asks
    return structured


def ids(compiler, text: str) -> list[int]:
    return compiler.lltokenizer.tokenize_bytes(text.encode())


def allowed_after(compiler, prefix: str) -> set[int]:
    matcher = compiler.matcher(CHOICE)
    assert matcher.consume_tokens(ids(compiler, prefix))
    return {i for i, v in enumerate(matcher.compute_logit_bias()) if v}


def masked_rows(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row != NEG_INF).flatten().tolist()) for row in logits]


def test_rows_are_masked_per_request_and_others_untouched(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [])
    logits = torch.randn(3, compiler.vocab_size)
    assert structured.has_any(["x", "s"]) and not structured.has_any(["x"])
    assert structured.mask(["x", "y"], logits) is logits  # nobody structured: no copy
    before = logits.clone()
    masked = structured.mask(["x", "s", "y"], logits)
    assert masked is logits  # in place: the step's own logits
    logits = before
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert masked_rows(masked[1:2]) == [allowed_after(compiler, "")] and allowed_after(compiler, "") < set(range(300))
    keep = masked[1] != NEG_INF
    assert torch.equal(masked[1][keep], logits[1][keep])  # the allowed logits themselves unchanged
    assert structured.stats()["grammar_num_matchers"] == 1


def test_draft_rows_follow_the_drafts_and_the_matcher_is_rolled_back(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [])
    drafts = ids(compiler, "ab")
    logits = torch.zeros(1 + len(drafts) + 1, compiler.vocab_size)  # s: 1 + 2 rows; then t: 1 row
    masked = structured.mask(["s", "t"], logits.clone(), [drafts, []])
    assert masked_rows(masked[:3]) == [allowed_after(compiler, ""), allowed_after(compiler, "a"), allowed_after(compiler, "ab")]
    assert masked_rows(masked[3:]) == [set(range(compiler.vocab_size))]
    again = structured.mask(["s", "t"], logits.clone(), [drafts, []])
    assert torch.equal(again, masked)  # the drafts were not kept


def test_a_forbidden_draft_leaves_the_rows_after_it_as_they_are(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [])
    drafts = ids(compiler, "c") + ids(compiler, "a")  # "c" starts no choice
    logits = torch.randn(3, compiler.vocab_size)
    masked = structured.mask(["s"], logits.clone(), [drafts])
    assert masked_rows(masked[:1]) == [allowed_after(compiler, "")]
    assert drafts[0] not in masked_rows(masked[:1])[0]  # the target can never equal it: rejected
    assert torch.equal(masked[1:], logits[1:])


def test_the_matcher_follows_sampled_tokens_and_a_restart_rebuilds_it(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [])
    structured.advance("s", ids(compiler, "a"))
    structured.advance("s", ids(compiler, "b"))
    logits = torch.zeros(1, compiler.vocab_size)
    after_ab = masked_rows(structured.mask(["s"], logits.clone()))
    assert after_ab == [allowed_after(compiler, "ab")]
    structured.start("s", CHOICE, ids(compiler, "ab"))  # back after a preemption, with its tokens
    assert masked_rows(structured.mask(["s"], logits.clone())) == after_ab
    structured.advance("unknown", [5])  # no matcher: nothing
    structured.finish("s")
    assert not structured.has_any(["s"])


def test_a_matcher_in_error_allows_only_the_end(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, ids(compiler, "zz"))  # refused: logged, the matcher is in error
    masked = structured.mask(["s"], torch.zeros(1, compiler.vocab_size))
    assert masked_rows(masked) == [{compiler.eos_token_id}]


def test_ignoring_eos_goes_on_unmasked_once_the_grammar_is_complete(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [], ignore_eos=True)
    structured.start("t", CHOICE, [])
    for request_id in ("s", "t"):
        structured.advance(request_id, ids(compiler, "b"))  # "b": a whole choice
    logits = torch.zeros(2, compiler.vocab_size)
    masked = structured.mask(["s", "t"], logits.clone())
    assert masked_rows(masked) == [set(range(compiler.vocab_size)), {compiler.eos_token_id}]
    structured.advance("s", ids(compiler, "zz"))  # past the grammar: nothing consumed, nothing refused
    assert masked_rows(structured.mask(["s"], logits[:1].clone())) == [set(range(compiler.vocab_size))]
    structured.finish("s")
    structured.start("s", CHOICE, ids(compiler, "b"))  # the same id again, not ignoring: masked
    assert masked_rows(structured.mask(["s"], logits[:1].clone())) == [{compiler.eos_token_id}]


def test_a_request_after_one_with_drafts_gets_its_own_row(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [])
    logits = torch.randn(5, compiler.vocab_size)
    masked = structured.mask(["t", "u", "s"], logits.clone(), [[7, 8], [], []])  # t: 1 + 2 rows; t, u unstructured
    assert torch.equal(masked[:4], logits[:4])
    assert masked_rows(masked[4:]) == [allowed_after(compiler, "")]


def test_drafts_consumed_before_a_refused_one_are_rolled_back(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [])
    drafts = ids(compiler, "a") + ids(compiler, "z")  # "a" starts two choices, "az" none
    logits = torch.randn(3, compiler.vocab_size)
    masked = structured.mask(["s"], logits.clone(), [drafts])
    assert masked_rows(masked[:2]) == [allowed_after(compiler, ""), allowed_after(compiler, "a")]
    assert torch.equal(masked[2], logits[2])
    # The matcher is back where it was, and not in error: the next step's row is the first one's.
    assert masked_rows(structured.mask(["s"], logits[:1].clone())) == [allowed_after(compiler, "")]


def test_a_refused_first_draft_leaves_the_matcher_usable(compiler):
    structured = sampling(compiler)
    structured.start("s", CHOICE, [])
    structured.mask(["s"], torch.zeros(2, compiler.vocab_size), [ids(compiler, "z")])
    structured.advance("s", ids(compiler, "a"))  # a matcher in error would refuse it and allow only the end
    assert masked_rows(structured.mask(["s"], torch.zeros(1, compiler.vocab_size))) == [allowed_after(compiler, "a")]


def test_finishing_an_unknown_request_is_a_no_op_and_stats_show_the_compiler(compiler):
    structured = sampling(compiler)
    structured.finish("never-started")
    assert structured.stats() == {"grammar_num_matchers": 0}  # no compiler made yet
    structured.start("s", CHOICE, [])
    stats = structured.stats()
    assert stats["grammar_num_matchers"] == 1 and stats["grammar_num_compiled"] == 1
