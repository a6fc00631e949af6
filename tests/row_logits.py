"""Logits rows as the last stage samples them, keyed by what they were computed from, for bit-exact
comparisons across runs that batch, cache, preempt, hand over or draft differently."""

from __future__ import annotations

import torch

from asyncpp.worker.model_runner import ModelRunner


class RowRecorder:
    """Each logits row the last stage samples from, keyed by (prompt, the tokens after it the row was
    computed from); with how many drafts of its step came before it."""

    def __init__(self, monkeypatch) -> None:
        self.rows: dict[tuple, tuple[int, torch.Tensor]] = {}
        self.conflicts: list[tuple] = []  # a row computed twice in one run (a recompute) with other bits
        original = ModelRunner._sample

        def spy(runner, state):
            row = 0
            for i, req_id in enumerate(state.sampling_req_ids):
                s = runner.sampling_states[req_id]
                drafts = state.draft_token_ids[i] if state.draft_token_ids is not None else []
                for j in range(len(drafts) + 1):
                    key = (tuple(s.prompt_token_ids), tuple(s.output_token_ids) + tuple(drafts[:j]))
                    logits = state.logits[row + j].detach().clone()
                    if key in self.rows and not torch.equal(self.rows[key][1], logits):
                        self.conflicts.append(key)
                    self.rows[key] = (j, logits)
                row += len(drafts) + 1
            return original(runner, state)

        monkeypatch.setattr(ModelRunner, "_sample", spy)

    def take(self) -> dict[tuple, tuple[int, torch.Tensor]]:
        """The rows since the last `take`; fails if one was computed twice with different bits."""
        rows, self.rows = self.rows, {}
        conflicts, self.conflicts = self.conflicts, []
        assert not conflicts, f"{len(conflicts)} rows computed twice with different bits"
        return rows


def assert_rows_equal_single_rows(spec: dict, plain: dict) -> int:
    """Every row drafting computed after the very tokens plain decoding produced (after right drafts
    only: the same key) equals plain's row bit for bit. Returns how many of them came after a draft."""
    num_after_drafts = 0
    for key, (num_drafts_before, row) in spec.items():
        if key in plain:
            expected = plain[key][1]
            assert row.dtype == torch.float32, "logits reach the sampler in float32"
            assert torch.equal(row, expected), f"{len(key[1])} tokens in: differs by {float((row - expected).abs().max())}"
            num_after_drafts += num_drafts_before > 0
    return num_after_drafts
