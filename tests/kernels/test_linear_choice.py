"""Choosing, per CPU, from how many rows the bfloat16 linears take float32 FMA: each branch with a fake
measurement (the hook), then the real one on this CPU, and the bits two start-ups give."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from asyncpp.kernels.isa import CpuInfo, cpu_info
from asyncpp.kernels.linear_choice import PROBE_ROWS, _read_cache, _wide_bf16, choose_fma_min_rows, min_rows_from

XEON = CpuInfo("Xeon", frozenset({"avx512f", "avx512_bf16"}), "x86_64")
ZEN4 = CpuInfo("Zen 4", frozenset({"avx512f", "avx512_bf16"}), "x86_64")
FAKE_KERNEL = SimpleNamespace(library=SimpleNamespace(_name="/cache/linear_bf16-avx512_bf16-0123.so"))


def _table(fma_over_dp: dict[int, float]) -> dict[int, tuple[float, float]]:
    return {rows: (10.0, 10.0 * fma_over_dp[rows]) for rows in PROBE_ROWS}


@pytest.mark.parametrize(
    "ratios,expected",
    [
        ({2: 0.5, 4: 0.7, 8: 1.0, 16: 1.2, 32: 1.5, 64: 1.8}, 16),  # the Xeon: FMA from 16 rows
        ({2: 0.4, 4: 0.4, 8: 0.45, 16: 0.5, 32: 0.5, 64: 0.5}, None),  # the Zen 4: never
        ({2: 1.1, 4: 1.1, 8: 1.1, 16: 1.1, 32: 1.1, 64: 1.1}, 2),  # at every probe
        ({2: 0.5, 4: 0.7, 8: 1.2, 16: 0.9, 32: 1.3, 64: 1.4}, 32),  # a dip at 16: only from above it
        ({2: 0.5, 4: 0.7, 8: 1.0, 16: 1.2, 32: 1.04, 64: 1.5}, 64),  # 32 within the margin: not enough
        ({2: 0.5, 4: 0.7, 8: 1.0, 16: 1.2, 32: 1.5, 64: 0.9}, None),  # losing at the most rows: never
    ],
)
def test_fma_from_the_smallest_probe_it_wins_at_and_above(ratios, expected):
    assert min_rows_from(_table(ratios)) == expected


def _choose(tmp_path, info=XEON, ratios=None, exact=True, calls=None, forced=-1):
    ratios = ratios or {"blocks": {2: 0.5, 4: 0.7, 8: 1.0, 16: 1.2, 32: 1.5, 64: 1.8},
                        "float": {2: 0.5, 4: 0.7, 8: 1.0, 16: 1.0, 32: 1.5, 64: 1.8}}  # fmt: skip

    def measure(kind: str, rows: int) -> tuple[float, float]:
        if calls is not None:
            calls.append((kind, rows))
        return 40.0, 40.0 * ratios[kind][rows]

    return choose_fma_min_rows(FAKE_KERNEL, forced, info, measure, lambda kernel: exact, tmp_path / "choice.json")


def test_a_measured_choice_per_weight_kind_is_cached_for_this_cpu(tmp_path):
    calls = []
    choice = _choose(tmp_path, calls=calls)
    assert (choice.block_rows, choice.float_rows, choice.source) == (16, 32, "measured")
    assert sorted(calls) == sorted((kind, rows) for kind in ("blocks", "float") for rows in PROBE_ROWS)
    assert choice.reason == (
        "GGUF blocks float32 FMA from 16 rows, float weights float32 FMA from 32 rows"
        " (measured at 64 rows: vdpbf16ps 40, FMA 72 GMAC/s)"
    )
    entries = json.loads((tmp_path / "choice.json").read_text())
    measured = "measured at 64 rows: vdpbf16ps 40, FMA 72 GMAC/s"
    assert list(entries.values()) == [{"block_rows": 16, "float_rows": 32, "measured": measured}]
    # Another CPU model gets an entry of its own; the first one stays.
    never = {kind: dict.fromkeys(PROBE_ROWS, 0.5) for kind in ("blocks", "float")}
    other = _choose(tmp_path, info=ZEN4, ratios=never)
    assert (other.block_rows, other.float_rows) == (None, None)
    assert other.reason.startswith("vdpbf16ps at every row count (measured")
    assert len(json.loads((tmp_path / "choice.json").read_text())) == 2


def test_a_cached_choice_is_read_back_without_measuring(tmp_path, monkeypatch):
    first = _choose(tmp_path)
    monkeypatch.setattr("asyncpp.kernels.linear_choice.measure_paths", lambda *a: pytest.fail("measured again"))
    probed_again = lambda kernel: pytest.fail("probed again")  # noqa: E731
    again = choose_fma_min_rows(FAKE_KERNEL, -1, XEON, None, probed_again, tmp_path / "choice.json")
    assert (again.block_rows, again.float_rows, again.source) == (first.block_rows, first.float_rows, "cached")
    assert again.reason == (
        "GGUF blocks float32 FMA from 16 rows, float weights float32 FMA from 32 rows"
        " (measured at 64 rows: vdpbf16ps 40, FMA 72 GMAC/s, cached)"
    )


def test_an_unreadable_cache_is_a_miss(tmp_path):
    path = tmp_path / "choice.json"
    for text in ("{not json", "[1, 2]", '{"k": {"block_rows": 1}}', '{"k": 3}'):
        path.write_text(text)
        assert _read_cache(path, "k") is None
    assert _read_cache(tmp_path / "missing.json", "k") is None
    assert _choose(tmp_path).source == "measured"  # and it is written over


def test_where_fma_gives_other_bits_rows_never_take_it(tmp_path):
    calls = []
    choice = _choose(tmp_path, exact=False, calls=calls)
    assert (choice.block_rows, choice.float_rows, choice.source) == (None, None, "inexact")
    assert calls == [] and not (tmp_path / "choice.json").exists()


@pytest.mark.parametrize("forced,rows", [(0, None), (1, 1), (24, 24)])
def test_model_fma_min_rows_forces_the_count_without_measuring(tmp_path, forced, rows):
    calls = []
    choice = _choose(tmp_path, calls=calls, forced=forced)
    assert (choice.block_rows, choice.float_rows, choice.source) == (rows, rows, "forced")
    assert calls == [] and "model.fma_min_rows" in choice.reason


_START_UP = """
import hashlib, sys, torch
from pathlib import Path
from asyncpp.kernels.linear_bf16 import bf16_kernel
from asyncpp.kernels.linear_choice import choose_fma_min_rows
kernel = bf16_kernel("avx512_bf16")
choice = choose_fma_min_rows(kernel, int(sys.argv[1]), cache=Path(sys.argv[2]))
kernel.set_fma_min_rows(choice.float_rows, choice.block_rows)
g = torch.Generator().manual_seed(0)
w = torch.randint(0, 256, (96, 6 * 20), dtype=torch.uint8, generator=g)
w[:, 0::20] = 0; w[:, 1::20] = 20  # float16 scales 2^-13..
packed = kernel.pack_blocks("q4_1", w, 96, 192)
digest = hashlib.sha256()
for rows in (1, 8, 16, 64, 200):
    x = torch.randn(rows, 192, generator=g).to(torch.bfloat16)
    digest.update(kernel.linear_blocks("q4_1", x, packed, 96).view(torch.int16).numpy().tobytes())
print(choice.source, choice.block_rows, digest.hexdigest())
"""


def test_two_start_ups_give_the_same_bits_whatever_they_choose(tmp_path):
    """Two processes measure afresh (each its own cache), a third never takes FMA, a fourth always does
    from 2 rows: the same bits at every row count."""
    if not cpu_info().supports("avx512_bf16"):
        pytest.skip("linear_bf16 needs AVX512-BF16")
    outs = [
        subprocess.run(
            [sys.executable, "-c", _START_UP, str(forced), str(tmp_path / f"c{i}.json")],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout.split()
        for i, forced in enumerate((-1, -1, 0, 2))
    ]  # fmt: skip
    assert [o[0] for o in outs] == ["measured", "measured", "forced", "forced"]
    assert outs[3][1] == "2" and outs[2][1] == "None"
    assert len({o[2] for o in outs}) == 1, outs


def test_fma_exactly_at_the_margin_is_chosen():
    assert min_rows_from(_table({2: 0.5, 4: 0.7, 8: 1.0, 16: 1.0, 32: 1.04, 64: 1.05})) == 64



def test_the_same_count_for_both_kinds_reads_as_one(tmp_path):
    same = {kind: {2: 0.5, 4: 0.7, 8: 1.0, 16: 1.2, 32: 1.5, 64: 1.8} for kind in ("blocks", "float")}
    choice = _choose(tmp_path, ratios=same)
    assert choice.reason == "float32 FMA from 16 rows (measured at 64 rows: vdpbf16ps 40, FMA 72 GMAC/s)"
    assert choice.gmacs["blocks"][16] == (40.0, 48.0) and set(choice.gmacs) == {"blocks", "float"}


def test_the_hooks_get_this_kernel_and_the_default_measure_times_it(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("asyncpp.kernels.linear_choice.measure_paths", lambda *a: seen.append(a) or (10.0, 20.0))
    choice = choose_fma_min_rows(FAKE_KERNEL, -1, XEON, None, lambda k: seen.append(k) or True, tmp_path / "c.json")
    assert seen[0] is FAKE_KERNEL and choice.block_rows == 2
    assert sorted(seen[1:]) == sorted((FAKE_KERNEL, kind, rows) for kind in ("blocks", "float") for rows in PROBE_ROWS)


def test_the_default_cache_is_in_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCPP_KERNEL_CACHE", str(tmp_path))
    choose_fma_min_rows(FAKE_KERNEL, -1, XEON, lambda kind, rows: (1.0, 2.0), lambda k: True)
    assert list(json.loads((tmp_path / "linear_choice.json").read_text()).values())[0]["block_rows"] == 2


def test_an_entry_per_cpu_model_flags_and_kernel_build(tmp_path):
    _choose(tmp_path)
    other_flags = CpuInfo("Xeon", frozenset({"avx512f", "avx512_bf16", "amx_tile"}), "x86_64")
    _choose(tmp_path, info=other_flags)
    other_build = SimpleNamespace(library=SimpleNamespace(_name="/cache/linear_bf16-avx512_bf16-4567.so"))
    choose_fma_min_rows(other_build, -1, XEON, lambda kind, rows: (1.0, 2.0), lambda k: True, tmp_path / "choice.json")
    assert len(json.loads((tmp_path / "choice.json").read_text())) == 3


def test_a_cache_that_is_not_a_table_is_replaced_and_an_unwritable_one_is_skipped(tmp_path):
    path = tmp_path / "choice.json"
    path.write_text("[1, 2]")
    _choose(tmp_path)
    assert isinstance(json.loads(path.read_text()), dict) and len(json.loads(path.read_text())) == 1
    path.write_text('{"other": {"block_rows": 8, "float_rows": 8}}')
    assert _read_cache(path, "missing") is None
    _choose(tmp_path)
    assert set(json.loads(path.read_text())) >= {"other"}  # kept beside the new entry
    blocked = tmp_path / "file"
    blocked.write_text("")
    choice = choose_fma_min_rows(FAKE_KERNEL, -1, XEON, lambda k, r: (1.0, 2.0), lambda k: True, blocked / "c.json")
    assert choice.source == "measured"  # measured all the same, nothing cached


def test_an_entry_without_what_was_measured_still_reads(tmp_path):
    first = _choose(tmp_path)
    path = tmp_path / "choice.json"
    entries = json.loads(path.read_text())
    for entry in entries.values():
        del entry["measured"]
    path.write_text(json.dumps(entries))
    again = choose_fma_min_rows(FAKE_KERNEL, -1, XEON, None, lambda kernel: True, path)
    assert again.source == "cached" and again.reason.endswith("(measured before on this CPU)")
    assert again.block_rows == first.block_rows


def test_wide_values_have_denormals_zeros_of_both_signs_and_their_exponents():
    import torch

    gen = torch.Generator().manual_seed(1)
    bits = _wide_bf16(64, 64, gen, (0, 12)).view(torch.int16).to(torch.int32) & 0xFFFF
    exponents = (bits >> 7) & 0xFF
    assert int(exponents.max()) <= 12 and bool((exponents == 0).any())
    zeros = bits[(bits & 0x7FFF) == 0]
    assert {0, 0x8000} <= set(zeros.tolist())  # +0 and -0
    assert bool(((exponents == 0) & ((bits & 0x7F) != 0)).any())  # denormals proper
    high = _wide_bf16(64, 64, gen, (100, 150)).view(torch.int16).to(torch.int32) & 0xFFFF
    nonzero = high[(high & 0x7FFF) != 0]
    assert int(((nonzero >> 7) & 0xFF).min()) >= 100 and int(((nonzero >> 7) & 0xFF).max()) <= 150
    assert bool((nonzero & 0x8000 != 0).any()) and bool((nonzero & 0x8000 == 0).any())


@pytest.fixture
def real_kernel():
    if not cpu_info().supports("avx512_bf16"):
        pytest.skip("linear_bf16 needs AVX512-BF16")
    from asyncpp.kernels.linear_bf16 import bf16_kernel

    kernel = bf16_kernel("avx512_bf16")
    if kernel is None:
        pytest.skip("linear_bf16 kernel unavailable (no C compiler)")
    before = kernel.fma_min_rows()
    yield kernel
    kernel.set_fma_min_rows(*before)


def test_the_probe_finds_this_cpus_fma_exact_and_a_path_with_other_bits_not(real_kernel):
    import torch

    from asyncpp.kernels.linear_choice import fma_matches_dpbf16

    real_kernel.set_fma_min_rows(7, 9)
    assert fma_matches_dpbf16(real_kernel)
    assert real_kernel.fma_min_rows() == (7, 9)  # put back as found

    class OneUlpOff:  # the FMA path, off by one ulp in a single output
        def __init__(self, kernel):
            self.kernel, self.on = kernel, False

        def __getattr__(self, name):
            return getattr(self.kernel, name)

        def set_fma_min_rows(self, float_rows, block_rows):
            self.on = float_rows is not None
            self.kernel.set_fma_min_rows(float_rows, block_rows)

        def linear(self, *args, **kwargs):
            out = self.kernel.linear(*args, **kwargs)
            if self.on:
                flat = out.view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32).view(-1)
                flat[len(flat) // 2] += 1
            return out

    assert not fma_matches_dpbf16(OneUlpOff(real_kernel))


def test_measuring_times_both_paths_on_one_core_and_puts_everything_back(real_kernel):
    import torch

    from asyncpp.kernels.linear_choice import measure_paths

    real_kernel.set_fma_min_rows(None, 5)
    threads = torch.get_num_threads()
    for kind in ("blocks", "float"):
        dp, fma = measure_paths(real_kernel, kind, 8, repeats=2)
        assert 0.1 < dp < 1000 and 0.1 < fma < 1000, (kind, dp, fma)
    assert real_kernel.fma_min_rows() == (None, 5) and torch.get_num_threads() == threads
