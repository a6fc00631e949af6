"""The C decode-attention kernel against a float64 reference, and against the torch path it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncpp.kernels import build, decode_attention
from asyncpp.kernels.isa import cpu_info, native_level
from asyncpp.kernels.decode_attention import decode_attention_kernel
from asyncpp.model.attention import AttentionMetadata, paged_attention

BLOCK_SIZE = 16


LEVELS = [lv for lv in cpu_info().supported_levels if lv != "amx"]  # amx builds the C kernels like avx512_bf16


def _kernel_or_skip(dtype, num_heads, num_kv_heads, head_dim, isa=None):
    fn = decode_attention_kernel("cpu", dtype, num_heads, num_kv_heads, head_dim, isa=isa)
    if fn is None:
        pytest.skip("no C compiler: the decode kernel is unavailable here")
    return fn


def _case(num_heads, num_kv_heads, head_dim, context_lens, dtype, seed=0, block_size=BLOCK_SIZE):
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(context_lens)
    max_blocks = -(-max(context_lens) // block_size)
    num_blocks = num_reqs * max_blocks + 3
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    # Scattered, non-monotonic blocks; unused table entries point at block 0 like the runner's padding.
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int64)
    for i, n in enumerate(context_lens):
        used = -(-n // block_size)
        block_table[i, :used] = perm[i * max_blocks : i * max_blocks + used]
    # q is a strided view, as in the model (q and k heads share one projection output).
    qk = torch.randn(num_reqs, num_heads + num_kv_heads, head_dim, generator=g).to(dtype)
    return qk[:, :num_heads], k_cache, v_cache, block_table, torch.tensor(context_lens, dtype=torch.int64)


def _reference(q, k_cache, v_cache, block_table, context_lens, scale, block_size=BLOCK_SIZE):
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    out = []
    for i, n in enumerate(context_lens.tolist()):
        pos = torch.arange(n)
        slots = block_table[i, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v).reshape(num_heads * head_dim))
    return torch.stack(out)


def _run(fn, q, k_cache, v_cache, block_table, context_lens, rows=None, num_rows=None, block_size=BLOCK_SIZE):
    rows = torch.arange(q.shape[0]) if rows is None else rows
    out = torch.full((num_rows or q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype)
    scale = q.shape[2] ** -0.5
    fn(q, k_cache, v_cache, block_table, rows, context_lens, int(context_lens.max()), block_size, out, scale)
    return out, scale


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (4, 2, 16), (8, 2, 64), (4, 4, 32), (6, 1, 128), (3, 3, 48)],
)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("isa", LEVELS)
def test_matches_float64_reference(num_heads, num_kv_heads, head_dim, dtype, atol, isa):
    fn = _kernel_or_skip(dtype, num_heads, num_kv_heads, head_dim, isa)
    # 1 key, block boundaries (15/16/17, 32) and longer contexts in one batch.
    q, k_cache, v_cache, block_table, context_lens = _case(
        num_heads, num_kv_heads, head_dim, [1, 15, 16, 17, 32, 100, 203], dtype
    )
    out, scale = _run(fn, q, k_cache, v_cache, block_table, context_lens)
    ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("block_size", [1, 5, 24, 32])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_blocks_of_other_sizes_than_a_tile(block_size, dtype, atol):
    """The kernel walks 16 positions at a time; blocks may end inside such a tile, or hold several."""
    fn = _kernel_or_skip(dtype, 9, 3, 64)
    q, k_cache, v_cache, block_table, context_lens = _case(9, 3, 64, [1, 15, 17, 48, 131], dtype, 2, block_size)
    out, scale = _run(fn, q, k_cache, v_cache, block_table, context_lens, block_size=block_size)
    ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale, block_size)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


def test_writes_only_the_given_rows():
    fn = _kernel_or_skip(torch.float32, 4, 2, 16)
    q, k_cache, v_cache, block_table, context_lens = _case(4, 2, 16, [5, 40], torch.float32)
    # The two decode queries sit at rows 1 and 3 of a 5-token step (prefill rows in between).
    q_rows = torch.zeros(5, *q.shape[1:])
    q_rows[1], q_rows[3] = q[0], q[1]
    rows = torch.tensor([1, 3])
    out, scale = _run(fn, q_rows, k_cache, v_cache, block_table, context_lens, rows=rows, num_rows=5)
    ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale)
    torch.testing.assert_close(out[rows].double(), ref, atol=2e-6, rtol=2e-6)
    assert out[[0, 2, 4]].isnan().all(), "rows of other tokens must be left alone"


@pytest.mark.parametrize("isa", LEVELS)
def test_batch_invariant_and_thread_invariant(isa):
    """Threads take contiguous ranges of rows balanced by context length: a row's result must not depend
    on which thread computes it, what it computed before (its prefetches) or how many threads there are,
    more than rows included."""
    fn = _kernel_or_skip(torch.bfloat16, 9, 3, 64, isa)
    q, k_cache, v_cache, block_table, context_lens = _case(9, 3, 64, [7, 64, 130, 33, 250, 1], torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [_run(fn, q[i : i + 1], k_cache, v_cache, block_table[i : i + 1], context_lens[i : i + 1])[0][0]
                 for i in range(q.shape[0])]  # fmt: skip
        for num_threads in (1, 2, 3, 8):
            torch.set_num_threads(num_threads)
            together, _ = _run(fn, q, k_cache, v_cache, block_table, context_lens)
            for i in range(q.shape[0]):
                assert torch.equal(alone[i], together[i]), f"request {i} changed with {num_threads} threads"
    finally:
        torch.set_num_threads(threads)


def test_prefill_rows_share_a_request():
    """A prefill chunk's tokens are rows of one request at consecutive positions (same block table)."""
    fn = _kernel_or_skip(torch.float32, 9, 3, 64)
    q, k_cache, v_cache, block_table, _ = _case(9, 3, 64, [40], torch.float32)
    q = torch.randn(12, 9, 64, generator=torch.Generator().manual_seed(3))
    context_lens = torch.arange(29, 41)  # positions 28..39 of the request
    block_table = block_table.expand(12, -1).contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out, scale = _run(fn, q, k_cache, v_cache, block_table, context_lens)
    finally:
        torch.set_num_threads(threads)
    ref = _reference(q, k_cache, v_cache, block_table, context_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_kernel_equals_torch_path(dtype):
    """A mixed prefill + decode step through `paged_attention`, with and without the kernel."""
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    fn = _kernel_or_skip(dtype, num_heads, num_kv_heads, head_dim)
    g = torch.Generator().manual_seed(1)
    start_positions = np.array([5, 0, 40, 17, 0, 63])
    num_new_tokens = np.array([1, 9, 1, 1, 20, 1])
    block_table = np.arange(6 * 6).reshape(6, 6)[:, ::-1].copy()
    num_tokens = int(num_new_tokens.sum())
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    cache_shape = (36 * BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype)
    outs = []
    for kernel in (None, fn):
        meta, _ = AttentionMetadata.build(
            start_positions, num_new_tokens, block_table, BLOCK_SIZE, "cpu", dtype, decode_kernel=kernel
        )
        assert (meta.kernel_rows is not None) == (kernel is not None)
        outs.append(paged_attention(qk[:, :num_heads], k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5))
    atol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=atol)


def test_levels_agree_within_float32_rounding():
    """GCC vector code; the vector width a level lowers it to may reorder a reduction (AVX2 and generic
    agree bit for bit here, AVX-512 by an ulp or so), never more than float32 rounding."""
    levels = {isa: _kernel_or_skip(torch.float32, 9, 3, 64, isa) for isa in LEVELS}
    q, k_cache, v_cache, block_table, context_lens = _case(9, 3, 64, [3, 70, 129], torch.float32)
    outs = [_run(fn, q, k_cache, v_cache, block_table, context_lens)[0] for fn in levels.values()]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.skipif("avx2" not in LEVELS, reason="the CPU does not run AVX2")
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (4, 2, 16), (6, 1, 128), (3, 3, 48), (16, 1, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_gives_the_generic_levels_bits(num_heads, num_kv_heads, head_dim, dtype):
    """AVX2 has its own score, value and softmax loops (8-lane halves of the 16-lane vectors) doing the
    generic level's operations in its order: the same bits, contexts ending at every kind of boundary."""
    kernels = [_kernel_or_skip(dtype, num_heads, num_kv_heads, head_dim, isa) for isa in ("generic", "avx2")]
    case = _case(num_heads, num_kv_heads, head_dim, [1, 7, 8, 9, 15, 16, 17, 24, 100, 203], dtype, seed=4)
    generic, avx2 = (_run(fn, *case)[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                     for fn in kernels)  # fmt: skip
    assert torch.equal(avx2, generic)


def test_unsupported_shapes_and_devices_fall_back():
    assert decode_attention_kernel("cpu", torch.float32, 4, 2, 24) is None  # head_dim not a multiple of 16
    assert decode_attention_kernel("cpu", torch.float32, 5, 2, 16) is None  # heads not a multiple of kv heads
    assert decode_attention_kernel("cpu", torch.float16, 4, 2, 16) is None
    assert decode_attention_kernel("meta", torch.float32, 4, 2, 16) is None


@pytest.mark.parametrize(
    ("shape", "served"),
    [
        ((4, 2, 256), True), ((4, 2, 272), False),  # head_dim up to 256
        ((16, 1, 64), True), ((17, 1, 64), False),  # up to 16 query heads per kv head
        ((6, 4, 64), False),  # 6 heads over 4 kv heads: not whole groups (6 // 4 * 4 != 6)
    ],
)
def test_the_kernel_serves_head_dims_up_to_256_and_groups_up_to_16(shape, served):
    assert decode_attention.serves(torch.float32, *shape) is served


def test_build_cache_and_disable_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCPP_KERNEL_CACHE", str(tmp_path))
    build.load_kernel_library.cache_clear()
    try:
        lib = build.load_kernel_library("decode_attention", native_level())
        if lib is None:
            pytest.skip("no C compiler")
        built = list(tmp_path.glob(f"decode_attention-{native_level()}-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        build.load_kernel_library.cache_clear()
        assert build.load_kernel_library("decode_attention", native_level()) is not None
        assert built[0].stat().st_mtime_ns == mtime, "a cached build must be reused, not rebuilt"

        monkeypatch.setenv(build.DISABLE_ENV, "1")
        build.load_kernel_library.cache_clear()
        assert build.load_kernel_library("decode_attention", native_level()) is None
        assert decode_attention_kernel("cpu", torch.float32, 4, 2, 16) is None
    finally:
        build.load_kernel_library.cache_clear()


def _request_rows(num_heads, num_kv_heads, head_dim, dtype, spans, seed=5):
    """Rows of a few requests: request i has a row per context length in spans[i] (its tokens at
    consecutive positions, one block table), requests one after another."""
    g = torch.Generator().manual_seed(seed)
    longest = max(max(span) for span in spans)
    q, k_cache, v_cache, tables, _ = _case(num_heads, num_kv_heads, head_dim, [longest] * len(spans), dtype, seed)
    block_table = torch.cat([tables[i : i + 1].expand(len(span), -1) for i, span in enumerate(spans)]).contiguous()
    context_lens = torch.tensor([n for span in spans for n in span], dtype=torch.int64)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, block_table, context_lens


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (4, 2, 16), (6, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", LEVELS)
def test_rows_of_one_request_together_give_each_row_its_bits_alone(num_heads, num_kv_heads, head_dim, dtype, isa):
    """A request's rows (a token and its drafts, a prefill chunk) share their keys: the kernel computes up to 4
    of them together (16 with vdpbf16ps: each tile's keys transposed once). Every row must get the bits it
    gets alone (signed zeros included), whatever the group (1 to 16 rows and more, lengths ending inside, at
    and past a 16-key tile, odd and even), its neighbours and the thread count."""
    fn = _kernel_or_skip(dtype, num_heads, num_kv_heads, head_dim, isa)
    spans = [range(14, 20), range(1, 4), range(31, 36), [64], range(95, 104), range(200, 203), range(300, 321)]
    q, k_cache, v_cache, block_table, context_lens = _request_rows(num_heads, num_kv_heads, head_dim, dtype, spans)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [_run(fn, q[i : i + 1], k_cache, v_cache, block_table[i : i + 1], context_lens[i : i + 1])[0][0]
                 for i in range(q.shape[0])]  # fmt: skip
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for start in (0, 1, 2):  # groups cut at other rows
                together, _ = _run(fn, q[start:], k_cache, v_cache, block_table[start:], context_lens[start:])
                for i in range(start, q.shape[0]):
                    assert torch.equal(_bits(alone[i]), _bits(together[i - start])), f"row {i} ({num_threads} threads, from {start})"
    finally:
        torch.set_num_threads(threads)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("isa", LEVELS)
def test_a_rows_odd_last_position_ignores_the_value_after_it_even_in_the_sign_of_zero(isa):
    """vdpbf16ps sums positions in pairs: a row ending at an odd count pairs its last position with a zero
    weight, and with the next position's value where a longer row of its request reads it. 0 x -1 is -0, and
    -0 + -0 keeps a sign that +0 would not: here every earlier product of dim 0 flushes to -0 (tiny values,
    as vdpbf16ps flushes them), so the row's dim 0 is -0 or +0 depending on its neighbour unless that value
    is left out. The same bits alone and beside the longer row."""
    fn = _kernel_or_skip(torch.bfloat16, 2, 1, 32, isa)
    q = torch.ones(2, 2, 32)
    k_cache, v_cache = torch.zeros(16, 1, 32), torch.ones(16, 1, 32)
    k_cache[2] = 1.0  # position 2 scores highest: the earlier ones get weights of about 0.0035
    v_cache[:2, 0, 0] = -2e-38  # their products underflow: dim 0's sum stays a -0
    v_cache[2, 0, 0] = -0.0
    v_cache[3, 0, 0] = -1.0  # read by the 4-key row only
    q, k_cache, v_cache = q.to(torch.bfloat16), k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    block_table, context_lens = torch.zeros(2, 1, dtype=torch.int64), torch.tensor([3, 4])
    together, _ = _run(fn, q, k_cache, v_cache, block_table, context_lens)
    alone, _ = _run(fn, q[:1], k_cache, v_cache, block_table[:1], context_lens[:1])
    assert torch.equal(_bits(together[0]), _bits(alone[0])), (together[0, :2], alone[0, :2])


@pytest.mark.skipif("avx2" not in LEVELS, reason="the CPU does not run AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_rows_one_by_one_give_the_generic_levels_grouped_bits(dtype):
    """The generic level computes a request's rows in groups, AVX2 one by one: the same bits."""
    kernels = [_kernel_or_skip(dtype, 9, 3, 64, isa) for isa in ("generic", "avx2")]
    case = _request_rows(9, 3, 64, dtype, [range(10, 21), range(30, 35), range(1, 3)], seed=6)
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    generic, avx2 = (_run(fn, *case)[0].view(view) for fn in kernels)
    assert torch.equal(avx2, generic)
