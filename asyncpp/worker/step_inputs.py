"""Turn a `StepPlan` into the model's inputs.

Index math is numpy vectorised over tokens; the only Python loops run over
requests. On a GPU every int64 array of a step (token ids, positions, the
attention rows' indices, the logits rows) goes to the device in one copy
through persistent buffers (`asyncpp.worker.input_staging`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncpp.core.plan import PLACEHOLDER_TOKEN_ID, StepPlan
from asyncpp.kernels.decode_attention import DecodeAttention
from asyncpp.model.attention import AttentionMetadata
from asyncpp.worker.async_output import DeviceTokens
from asyncpp.worker.input_staging import StagedUpload


@dataclass
class StepInputs:
    num_tokens: int
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_meta: AttentionMetadata
    # The rows logits are computed for: per request that samples, its last token row, preceded by
    # one row per draft it verifies (speculative decoding), in request order.
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]
    draft_token_ids: list[list[int]] | None = None  # per sampling request; None when no request has drafts


class StepInputBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        decode_kernel: DecodeAttention | None = None,
        max_blocks_per_req: int = 0,
        staged: bool | None = None,
    ) -> None:
        """`max_blocks_per_req` sizes the staging buffers (0: a guess; what does not fit is copied on
        its own); `staged` forces the one-copy staging on (CPU tests) or off (default: on CUDA)."""
        self.max_num_tokens = max_num_tokens
        self.decode_kernel = decode_kernel  # None: decode attention on the torch path
        self.dtype = dtype  # of the activations: attention masks are built in it
        self.block_size = block_size
        self.device = torch.device(device)
        # Per token: its id, position, slot, attention row, context length, logits row and block-table row.
        capacity = max_num_tokens * (6 + (max_blocks_per_req or 64))
        self.upload = StagedUpload(capacity, self.device, staged)

    def prepare(
        self,
        plan: StepPlan,
        sampled_token_ids: DeviceTokens | None = None,
        latest_drafts: dict[str, list[int]] | None = None,
        void_req_ids: frozenset[str] = frozenset(),
    ) -> StepInputs:
        """Inputs of `plan`; on the first stage, placeholders become the requests' `sampled_token_ids`
        followed by their `latest_drafts` (a continuation that verifies the drafts its plan before
        proposed); a token still only on the device is copied there on the device, after the
        host's tokens. `void_req_ids` (last stage): continuations computed but not sampled."""
        reqs = plan.scheduled
        num_new = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        num_tokens = int(num_new.sum())
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"step {plan.step_id} has {num_tokens} tokens, more than max_num_batched_tokens {self.max_num_tokens}"
            )
        starts = np.fromiter((r.start_position for r in reqs), dtype=np.int64, count=len(reqs))
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_table = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, r in enumerate(reqs):
            block_table[i, : len(r.block_ids)] = r.block_ids
        upload = self.upload
        upload.begin_step()
        meta, positions = AttentionMetadata.build(
            starts, num_new, block_table, self.block_size, self.device, self.dtype, self.decode_kernel, upload.stage
        )

        token_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
        on_device = None  # (rows, request ids) of placeholders whose token is still on the device
        if plan.after_step_id is not None and sampled_token_ids is not None:
            on_device = _fill_placeholders(token_ids, num_new, reqs, sampled_token_ids, latest_drafts or {})
        input_ids, positions = upload.stage(token_ids), upload.stage(positions)

        last_rows = np.cumsum(num_new) - 1
        do_sample = np.fromiter(
            (r.do_sample and r.request_id not in void_req_ids for r in reqs), dtype=bool, count=len(reqs)
        )
        sampling = [r for r, s in zip(reqs, do_sample) if s]
        logits_rows = last_rows[do_sample]
        draft_token_ids = None
        if any(r.num_draft_tokens for r in sampling):
            num_drafts = np.fromiter((r.num_draft_tokens for r in sampling), dtype=np.int64, count=len(sampling))
            num_rows = num_drafts + 1
            first_rows = np.repeat(logits_rows - num_drafts - np.cumsum(num_rows) + num_rows, num_rows)
            logits_rows = first_rows + np.arange(int(num_rows.sum()))
            draft_token_ids = [_drafts_of(r, latest_drafts or {}) for r in sampling]
        logits_indices = upload.stage(logits_rows)
        upload.flush()
        if on_device is not None:  # after the copy of the host's tokens
            sampled_token_ids.fill_on_device(input_ids, *on_device)
        return StepInputs(
            num_tokens=num_tokens,
            input_ids=input_ids,
            positions=positions,
            attn_meta=meta,
            logits_indices=logits_indices,
            sampling_req_ids=[r.request_id for r in sampling],
            draft_token_ids=draft_token_ids,
        )


def _padded_drafts(drafts: list[int], num_drafts: int) -> list[int]:
    """The `num_drafts` drafts a continuation verifies: the proposer's, padded by repeating its last
    (or token 0). Padding is only a poor guess: verification decides, as for any draft. The first
    stage (filling its inputs) and the last (verifying) pad alike."""
    if len(drafts) >= num_drafts:
        return list(drafts[:num_drafts])
    return list(drafts) + [drafts[-1] if drafts else 0] * (num_drafts - len(drafts))


def _drafts_of(r, latest_drafts: dict[str, list[int]]) -> list[int]:
    """The drafts a scheduled request verifies: in the plan, or (a continuation) the latest proposed."""
    drafts = r.token_ids[len(r.token_ids) - r.num_draft_tokens :]
    if drafts and drafts[0] == PLACEHOLDER_TOKEN_ID:
        return _padded_drafts(latest_drafts.get(r.request_id, []), r.num_draft_tokens)
    return list(drafts)


def _fill_placeholders(
    token_ids: np.ndarray,
    num_new: np.ndarray,
    reqs: list,
    sampled_token_ids: DeviceTokens,
    latest_drafts: dict[str, list[int]],
) -> tuple[np.ndarray, list[str]] | None:
    """Fill the placeholders the host can; return the rows (and their requests) whose token is
    still only on the device, or None when there are none."""
    rows = np.flatnonzero(token_ids == PLACEHOLDER_TOKEN_ID)
    if not len(rows):
        return None
    req_index = np.repeat(np.arange(len(reqs)), num_new)[rows]
    req_ids = [reqs[i].request_id for i in req_index.tolist()]
    # A request without a sampled token had its sampling step fail: the engine fails it and
    # drops this step's output for it, so any valid token will do.
    token_ids[rows] = [sampled_token_ids.get(req_id, 0) for req_id in req_ids]
    # A continuation's placeholders after its first are the drafts its plan before proposed.
    starts = np.cumsum(num_new) - num_new
    for i, r in enumerate(reqs):
        if r.num_draft_tokens and r.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            first = int(starts[i]) + r.num_tokens - r.num_draft_tokens
            drafts = _padded_drafts(latest_drafts.get(r.request_id, []), r.num_draft_tokens)
            token_ids[first : first + r.num_draft_tokens] = drafts
    # (Steps with drafts are never left on the device: a request has one pending token, its first row's.)
    pending = [(row, req_id) for row, req_id in zip(rows.tolist(), req_ids) if req_id in sampled_token_ids.pending]
    if not pending:
        return None
    return np.array([row for row, _ in pending], dtype=np.int64), [req_id for _, req_id in pending]
