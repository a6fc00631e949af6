"""num_blocks_for_budget: K and V for every layer of the stage, whole blocks only."""

from __future__ import annotations

import pytest

from asyncpp.kv.sizing import kv_bytes_per_block, num_blocks_for_budget


def test_bytes_per_block_counts_k_and_v_per_layer() -> None:
    # 2 (K, V) * 3 layers * 16 tokens * 4 heads * 8 dims * 2 bytes
    assert kv_bytes_per_block(16, 3, 4, 8, 2) == 2 * 3 * 16 * 4 * 8 * 2


def test_num_blocks_rounds_down_to_whole_blocks() -> None:
    per_block = 2 * 2 * 16 * 2 * 64 * 4
    assert num_blocks_for_budget(10 * per_block, 16, 2, 2, 64, 4) == 10
    assert num_blocks_for_budget(10 * per_block + per_block - 1, 16, 2, 2, 64, 4) == 10
    assert num_blocks_for_budget(per_block - 1, 16, 2, 2, 64, 4) == 0
    # Half the layers (a later pipeline stage) fits twice the blocks.
    assert num_blocks_for_budget(10 * per_block, 16, 1, 2, 64, 4) == 20


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        num_blocks_for_budget(-1, 16, 2, 2, 64, 4)
    with pytest.raises(ValueError, match="num_layers"):
        num_blocks_for_budget(1 << 20, 16, 0, 2, 64, 4)
