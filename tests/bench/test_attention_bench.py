"""The decode-attention benchmark: its caches placed as the engine's, and its bit-for-bit check of a baseline."""

from __future__ import annotations

from importlib import resources

import pytest
import torch

from asyncpp.bench.attention import Step, main
from asyncpp.kernels import huge_pages
from asyncpp.kernels.decode_attention import decode_attention_kernel
from asyncpp.kernels.isa import native_level
from tests.kernels.test_huge_pages import _mapping_of, needs_smaps

SOURCE = resources.files("asyncpp.kernels").joinpath("decode_attention.c").read_text()
SMALL = ["--layers", "2", "--requests", "3", "--min-context", "5", "--max-context", "40", "--threads", "1",
         "--repeats", "1", "--evict-mb", "1"]  # fmt: skip
needs_kernel = pytest.mark.skipif(
    decode_attention_kernel("cpu", torch.bfloat16, 9, 3, 64, native_level()) is None, reason="no C compiler here"
)


@needs_smaps
def test_large_caches_sit_on_huge_pages_as_the_engines_do():
    step = Step(1, [2000, 2000], 9, 3, 64, torch.bfloat16)  # 8000 slots of 384 bytes a cache: 3 MB
    for cache in step.caches[0]:
        assert "hg" in _mapping_of(cache.data_ptr())["VmFlags"].split()
        assert cache.shape == (8000, 3, 64) and cache.dtype == torch.bfloat16


def test_caches_hold_the_seeded_values():
    step = Step(2, [17, 40], 4, 2, 16, torch.float32, seed=3)
    again = Step(2, [17, 40], 4, 2, 16, torch.float32, seed=3)
    for (k, v), (k2, v2) in zip(step.caches, again.caches):
        assert torch.equal(k, k2) and torch.equal(v, v2) and k.std() > 0.5  # random normal values, not zeros
    g = torch.Generator().manual_seed(3)
    torch.randperm(2 * (2 + 3), generator=g)  # the block pool's shuffle comes first
    assert torch.equal(step.caches[0][0], torch.randn(k.shape, generator=g))


@needs_kernel
def test_a_baseline_of_the_same_source_is_bit_identical(tmp_path, capsys):
    same = tmp_path / "same.c"
    same.write_text(SOURCE)
    assert main([*SMALL, "--baseline", str(same)]) == 0
    out = capsys.readouterr().out
    assert f"{same}: bit-identical to this kernel on the step: True; on random cases: all" in out
    assert "ms/step" in out and "current" in out and "same" in out


@needs_kernel
def test_a_baseline_that_differs_is_named(tmp_path, capsys):
    changed = tmp_path / "changed.c"
    assert SOURCE.count("block_size, dtype, scale};") == 1
    changed.write_text(SOURCE.replace("block_size, dtype, scale};", "block_size, dtype, scale * 1.01f};"))
    assert main([*SMALL, "--baseline", str(changed)]) == 0
    out = capsys.readouterr().out
    assert f"{changed}: bit-identical to this kernel on the step: False; on random cases: not [" in out


def test_small_caches_stay_plain_tensors():
    step = Step(1, [5], 4, 2, 16, torch.bfloat16)  # 10 blocks of 16 slots: far under a huge page
    assert step.caches[0][0].untyped_storage().resizable()
    assert huge_pages.HUGE_PAGE > step.caches[0][0].numel() * 2


def test_a_step_lays_out_requests_as_the_engine_does():
    step = Step(2, [17, 2], 4, 2, 16, torch.bfloat16, seed=1, rows_per_request=3)
    # Each request's rows: its last 3 positions (a token and two drafts), at least one.
    assert step.context_lens.tolist() == [15, 16, 17, 1, 1, 2] and step.context_lens.dtype == torch.int64
    assert step.block_table.shape == (6, 2) and torch.equal(step.rows, torch.arange(6))
    first, second = step.block_table[0].tolist(), step.block_table[3, :1].tolist()
    assert all(torch.equal(step.block_table[i], step.block_table[0]) for i in (1, 2))  # one table per request
    assert len(set(first + second)) == 3 and max(first + second) < 6  # 3 distinct blocks of a pool of 6
    assert step.scale == 16**-0.5
    assert step.kv_bytes == (15 + 16 + 17 + 1 + 1 + 2) * 2 * 16 * 2 * 2  # K and V, 2 kv heads x 16 dims, bfloat16
    again = Step(2, [17, 2], 4, 2, 16, torch.bfloat16, seed=1, rows_per_request=3)
    assert all(torch.equal(q, q2) for q, q2 in zip(step.queries, again.queries))  # seeded
    assert torch.equal(step.block_table, again.block_table)


def test_requests_never_share_a_block():
    step = Step(1, [17, 20, 33], 4, 2, 16, torch.bfloat16)  # 2 + 2 + 3 blocks of a pool of 14
    blocks = [b for i, n in enumerate((2, 2, 3)) for b in step.block_table[i, :n].tolist()]
    assert len(set(blocks)) == 7 and all(0 <= b < 14 for b in blocks)
