"""`StructuredSampling`: the sampling stage's grammar matchers, and the masks they put on logits.

Runs where tokens are sampled (the last pipeline stage), beside the
sampling states: a request that asked for structured output gets a matcher
when it arrives (or arrives again after a preemption or a stage restart:
rebuilt from the tokens it has so far), and the matcher is advanced on the
tokens this stage samples, in the order it samples them. So async
scheduling (the next plan made before this step's tokens are known) and the
hand-off of sampled tokens to the first stage change nothing: no other
process holds grammar state.

`mask` sets every token the grammar forbids to -inf in the step's logits,
in place, before any penalty, temperature or filter: the sampler and the
rejection sampler then draw as they always do. A request verifying drafts owns 1 + d rows:
row j is masked as the grammar stands after drafts 1..j (consumed for the
mask, then rolled back), so a draft the grammar forbids can never equal the
target's token and is rejected; rows past a forbidden draft are never used
and stay as they are. Logprobs are taken from the masked logits (before
penalties and temperature), as vLLM's default `raw_logprobs` are: a token
the grammar forbids has a logprob of -inf.

A grammar that is complete allows end-of-sequence alone, so the answer ends
there (`finish_reason: "stop"`). A request that ignores end-of-sequence
(`ignore_eos`, benchmarks) goes on unconstrained past that point, as vLLM's
does: its matcher is done and masks nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from asyncpp.kernels.token_mask import apply_token_bitmask
from asyncpp.logging import get_logger
from asyncpp.sampling.structured import StructuredOutputs

if TYPE_CHECKING:
    import llguidance

    from asyncpp.structured.compiler import GrammarCompiler


class StructuredSampling:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        """`make_compiler` is called once, when the first request asks for structured output (it
        loads the tokenizer: a stage that never sees one never pays for it)."""
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._ignores_eos: set[str] = set()  # requests that go on past a complete grammar
        self.log = get_logger(role="stage", component="structured")

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def start(
        self, request_id: str, spec: StructuredOutputs, output_token_ids: Sequence[int], ignore_eos: bool = False
    ) -> None:
        """A request (new, or back with the tokens it has so far) gets its matcher."""
        matcher = self.compiler.matcher(spec)
        if ignore_eos:
            self._ignores_eos.add(request_id)
        self._matchers[request_id] = matcher
        self.advance(request_id, output_token_ids)

    def finish(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._ignores_eos.discard(request_id)

    def has_any(self, request_ids: Sequence[str]) -> bool:
        return bool(self._matchers) and any(r in self._matchers for r in request_ids)

    def advance(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The tokens this stage sampled for the request (accepted drafts, then one more)."""
        matcher = self._matchers.get(request_id)
        if matcher is not None:
            for token_id in token_ids:
                if self._is_done(request_id, matcher):
                    break
                self._consume(request_id, matcher, token_id)

    def mask(
        self, request_ids: Sequence[str], logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """`logits` ([rows, vocab], each request's 1 + drafts rows in order) with what the grammars
        forbid at -inf, in place (the step's own logits, which nothing reads unmasked)."""
        bitmask: torch.Tensor | None = None  # every row's allowed tokens, one bit each; all ones: unmasked
        row = 0
        for i, request_id in enumerate(request_ids):
            drafts = draft_token_ids[i] if draft_token_ids is not None else ()
            matcher = self._matchers.get(request_id)
            if matcher is not None and not self._is_done(request_id, matcher):
                if bitmask is None:
                    bitmask = torch.full((logits.shape[0], -(-self.compiler.vocab_size // 32)), -1, dtype=torch.int32)
                self._fill_rows(request_id, matcher, drafts, bitmask[row : row + 1 + len(drafts)])
            row += 1 + len(drafts)
        if bitmask is None:
            return logits
        apply_token_bitmask(logits, bitmask.to(logits.device))
        return logits

    def _fill_rows(self, request_id: str, matcher: llguidance.LLMatcher, drafts: Sequence[int], rows: torch.Tensor) -> None:
        """Row 0's allowed tokens, then each row's whose draft before it the grammar allows (the rest
        stay all ones)."""
        _fill(matcher, rows[0])
        if matcher.is_error():  # never for tokens its own masks allowed; its mask is end-of-sequence alone
            self.log.error("grammar_in_error", request_id=request_id, error=matcher.get_error())
            return
        num_consumed = 0
        for j, draft in enumerate(drafts):
            if not _is_allowed(rows[j], draft) or not matcher.consume_token(draft):
                break
            num_consumed += 1
            _fill(matcher, rows[j + 1])
        if num_consumed and not matcher.rollback(num_consumed):
            self.log.error("grammar_rollback_failed", request_id=request_id, error=matcher.get_error())

    def _is_done(self, request_id: str, matcher: llguidance.LLMatcher) -> bool:
        """Its grammar is complete and it ignores end-of-sequence: nothing more is masked."""
        return request_id in self._ignores_eos and matcher.is_stopped()

    def _consume(self, request_id: str, matcher: llguidance.LLMatcher, token_id: int) -> None:
        if not matcher.consume_token(token_id):  # never for a token its own mask allowed
            self.log.error("grammar_token_refused", request_id=request_id, token_id=token_id, error=matcher.get_error())

    def stats(self) -> dict[str, object]:
        return {"grammar_num_matchers": len(self._matchers), **(self._compiler.stats() if self._compiler else {})}


def _fill(matcher: llguidance.LLMatcher, row: torch.Tensor) -> None:
    """`row` ([words] int32, contiguous): the tokens the matcher allows next, one bit each (only
    end-of-sequence once it is done)."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def _is_allowed(row: torch.Tensor, token_id: int) -> bool:
    return 0 <= token_id < 32 * row.numel() and bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)
