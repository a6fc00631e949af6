"""Packed weights on huge-page-advised memory (`asyncpp/kernels/huge_pages.py`)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from asyncpp.kernels import huge_pages
from asyncpp.kernels.huge_pages import HUGE_PAGE, HugePageArena, weight_buffer
from asyncpp.kernels.linear_bf16 import bf16_native_kernel
from asyncpp.kernels.qlinear import qlinear_kernel

SMAPS = Path("/proc/self/smaps")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_smaps = pytest.mark.skipif(not SMAPS.exists() or not huge_pages.enabled(), reason="no huge pages here")


def _mapping_of(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding address `ptr`."""
    fields: dict[str, str] | None = None
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(a, 16) for a in head.split("-"))
            if fields is not None:
                break
            if start <= ptr < end:
                fields = {}
        elif fields is not None:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    assert fields is not None, f"no mapping holds {ptr:#x}"
    return fields


def _ranges_disjoint(tensors: list[torch.Tensor]) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_tensors_are_aligned_disjoint_sized_and_keep_their_bytes():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE)
    sizes = [1, 63, 64, 65, 5000, 1 << 20, 3]
    tensors = [arena.empty(n) for n in sizes]
    assert [t.numel() for t in tensors] == sizes
    assert all(t.dtype == torch.uint8 and t.data_ptr() % 64 == 0 for t in tensors)
    assert _ranges_disjoint(tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(tensors))
    assert tensors[0].data_ptr() % HUGE_PAGE == 0  # a chunk starts on a huge page


def test_a_full_chunk_starts_a_new_one_and_a_large_request_maps_its_own():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    small = [arena.empty(400_001) for _ in range(5)]  # 5 fit in 2 MB, the 6th does not
    assert [b.data_ptr() - a.data_ptr() for a, b in zip(small, small[1:])] == [400_064] * 4
    sixth = arena.empty(400_001)
    assert sixth.data_ptr() % HUGE_PAGE == 0 and _ranges_disjoint([*small, sixth])
    large = arena.empty(HUGE_PAGE // 4 + 1)  # over a quarter chunk: a mapping of its own
    assert large.data_ptr() % HUGE_PAGE == 0
    after = arena.empty(64)  # the current chunk goes on where it was
    assert after.data_ptr() == sixth.data_ptr() + 400_064
    quarter = arena.empty(HUGE_PAGE // 4)  # a quarter chunk still comes from the chunk
    assert quarter.data_ptr() == after.data_ptr() + 64
    assert _ranges_disjoint([*small, sixth, large, after, quarter])


def test_tensors_outlive_the_arena():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    t = arena.empty(1000)
    t.copy_(torch.arange(1000) % 251)
    del arena
    gc.collect()
    assert torch.equal(t, (torch.arange(1000) % 251).to(torch.uint8))


def test_bad_sizes_fail_clearly():
    with pytest.raises(ValueError, match="multiple of"):
        HugePageArena(chunk_bytes=HUGE_PAGE + 4096)
    with pytest.raises(ValueError, match="multiple of"):
        HugePageArena(chunk_bytes=0)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        HugePageArena().empty(-1)
    empty = HugePageArena().empty(0)
    assert empty.numel() == 0 and empty.dtype == torch.uint8
    with pytest.raises(ValueError, match="whole number of torch.bfloat16"):
        weight_buffer(3, torch.bfloat16)
    assert weight_buffer(2, torch.bfloat16).numel() == 1


def test_weight_buffer_views_its_bytes_as_the_dtype():
    t = weight_buffer(4096, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (2048,)


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("ASYNCPP_DISABLE_HUGE_PAGES", "1")
    assert not huge_pages.enabled()
    t = weight_buffer(1 << 20, torch.bfloat16)
    assert t.untyped_storage().resizable()  # torch.empty's; the arena's views of a mapping are not
    assert t.dtype == torch.bfloat16 and t.numel() == 1 << 19
    z = huge_pages.zeros((HUGE_PAGE, 2), torch.bfloat16)
    assert z.untyped_storage().resizable() and z.dtype == torch.bfloat16 and not z.any()
    for on in ("0", ""):
        monkeypatch.setenv("ASYNCPP_DISABLE_HUGE_PAGES", on)
        assert huge_pages.enabled() == hasattr(huge_pages.mmap, "MADV_HUGEPAGE")


@needs_smaps
def test_mappings_are_advised_for_huge_pages():
    t = HugePageArena().empty(HUGE_PAGE // 2)
    assert "hg" in _mapping_of(t.data_ptr())["VmFlags"].split()  # madvise(MADV_HUGEPAGE)
    plain = torch.empty(4 * HUGE_PAGE, dtype=torch.uint8)
    assert "hg" not in _mapping_of(plain.data_ptr())["VmFlags"].split()


@needs_smaps
@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off")
def test_touched_memory_is_backed_by_huge_pages():
    t = HugePageArena().empty(4 * HUGE_PAGE)
    t.fill_(7)
    assert int(_mapping_of(t.data_ptr())["AnonHugePages"].split()[0]) >= 2 * HUGE_PAGE // 1024


@needs_smaps
def test_the_kernels_pack_into_advised_memory():
    raw = torch.randint(0, 256, (64, 576 // 32 * 20), dtype=torch.uint8)
    raw.view(-1, 20)[:, 0:4] = torch.tensor([0, 0x20, 0, 0x20], dtype=torch.uint8)  # finite d and m
    kernels = [k for k in (qlinear_kernel("generic"), bf16_native_kernel()) if k is not None]
    if not kernels:
        pytest.skip("no kernel builds here")
    packed = [k.pack("q4_1", raw, 64, 576) for k in kernels]
    native = bf16_native_kernel()
    if native is not None:
        packed.append(native.pack("bf16", torch.randn(64, 576).bfloat16(), 64, 576))
    for p in packed:
        assert "hg" in _mapping_of(p.data_ptr())["VmFlags"].split()


@needs_smaps
def test_zeros_are_zero_and_advised_when_large():
    big = huge_pages.zeros((HUGE_PAGE // 128 + 3, 3, 64), torch.bfloat16)  # just over 3 MB
    assert big.shape == (HUGE_PAGE // 128 + 3, 3, 64) and big.dtype == torch.bfloat16
    assert big.data_ptr() % HUGE_PAGE == 0 and not big.any()
    assert "hg" in _mapping_of(big.data_ptr())["VmFlags"].split()
    big[-1].fill_(1.5)  # the whole extent is writable
    assert big[-1].eq(1.5).all() and not big[:-1].any()
    small = huge_pages.zeros((10, 3, 64), torch.bfloat16)  # under one huge page: torch.zeros
    assert not small.any() and small.untyped_storage().resizable() and small.dtype == torch.bfloat16
    one = huge_pages.zeros((HUGE_PAGE // 4,), torch.float32)  # exactly one huge page: a mapping
    assert not one.untyped_storage().resizable() and "hg" in _mapping_of(one.data_ptr())["VmFlags"].split()


@needs_smaps
def test_zeros_are_resident_before_any_write():
    """Every page of a `zeros` mapping is faulted in when it is made, not on a serving step's first write."""
    z = huge_pages.zeros((3 * HUGE_PAGE + 4096 * 5 + 64,), torch.uint8)
    fields = _mapping_of(z.data_ptr())
    rss_kb = int(fields["Rss"].split()[0])
    assert rss_kb * 1024 >= z.numel(), (rss_kb, z.numel())
    assert not z.any()


@needs_smaps
def test_cpu_kv_caches_live_on_advised_memory():
    from asyncpp.worker.kv_cache import allocate_kv_caches

    caches = allocate_kv_caches(2, 2048, 16, 3, 64, torch.bfloat16)  # 12 MB a tensor
    assert len(caches) == 2 and _ranges_disjoint([t for pair in caches for t in pair])
    for k, v in caches:
        assert k.shape == v.shape == (2048 * 16, 3, 64) and not k.any() and not v.any()
        assert "hg" in _mapping_of(k.data_ptr())["VmFlags"].split()
