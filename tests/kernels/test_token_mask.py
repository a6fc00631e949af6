"""The token bitmask kernel: the same logits as torch's masked_fill with the bits unpacked, for both
dtypes, any vocabulary size, words that stop short of it, and strided rows; the fallback agrees."""

from __future__ import annotations

import pytest
import torch

from asyncpp.kernels import token_mask
from asyncpp.kernels.token_mask import apply_token_bitmask, unpack_bitmask


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    allowed = torch.zeros(logits.shape, dtype=torch.bool)
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            w, b = divmod(t, 32)
            allowed[r, t] = w < bitmask.shape[1] and bool((int(bitmask[r, w]) >> b) & 1)
    return logits.masked_fill(~allowed, float("-inf"))


def bitmask(rows: int, words: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    mask[0] = -1  # all allowed
    if rows > 1:
        mask[1] = 0  # none
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, words", [(100, 4), (96, 3), (70, 2), (1, 1)])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_the_same_logits_as_masked_fill(dtype, vocab, words, use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(token_mask, "_library", lambda isa: None)
    logits = torch.randn(4, vocab).to(dtype)
    mask = bitmask(4, words)
    out = logits.clone()
    apply_token_bitmask(out, mask)
    assert torch.equal(out, reference(logits, mask))


def test_strided_rows_are_masked_in_place():
    base = torch.randn(3, 80)
    view = base[:, :64]  # rows 80 apart, 64 wide
    mask = bitmask(3, 2, seed=1)
    expected = reference(view.clone(), mask)
    apply_token_bitmask(view, mask)
    assert torch.equal(base[:, :64], expected) and torch.isfinite(base[:, 64:]).all()


def test_unpack_and_shapes():
    mask = torch.tensor([[0b101, -1]], dtype=torch.int32)
    allowed = unpack_bitmask(mask, 70)
    assert allowed[0, :3].tolist() == [True, False, True] and allowed[0, 32:64].all() and not allowed[0, 64:].any()
    with pytest.raises(ValueError, match="int32 bitmask"):
        apply_token_bitmask(torch.zeros(2, 8), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 bitmask"):
        apply_token_bitmask(torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columns_apart_and_a_strided_bitmask_still_give_masked_fill(dtype):
    logits = torch.randn(70, 3).to(dtype).t()  # [3, 70], columns 3 apart
    wide = bitmask(3, 6, seed=2)
    mask = wide[:, ::2]  # [3, 3], not contiguous
    expected = reference(logits.clone(), mask.contiguous())
    apply_token_bitmask(logits, mask)
    assert torch.equal(logits, expected)


def test_a_bitmask_for_a_single_row_must_match_two_dimensional_logits():
    with pytest.raises(ValueError, match="int32 bitmask"):
        apply_token_bitmask(torch.zeros(8), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 bitmask"):
        apply_token_bitmask(torch.zeros(1, 8), torch.zeros(1, dtype=torch.int32))


def test_the_fallback_unpacks_on_the_bitmask_s_device():
    """A CUDA step hands its logits and masks on the GPU: nothing is built on the CPU beside them
    (the meta device stands in for CUDA here)."""
    mask = torch.zeros(2, 3, dtype=torch.int32, device="meta")
    assert unpack_bitmask(mask, 70).device.type == "meta"
    logits = torch.zeros(2, 70, device="meta")
    apply_token_bitmask(logits, mask)
    assert logits.device.type == "meta"
