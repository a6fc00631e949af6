"""Choosing, per CPU, from how many rows the bfloat16 linears take float32 FMA: each branch with a fake
measurement (the hook), then the real one on this CPU, and the bits two start-ups give."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from asyncpp.kernels.isa import CpuInfo, cpu_info
from asyncpp.kernels.linear_choice import PROBE_ROWS, _read_cache, choose_fma_min_rows, min_rows_from

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
    again = choose_fma_min_rows(FAKE_KERNEL, -1, XEON, None, lambda kernel: True, tmp_path / "choice.json")
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


@pytest.mark.parametrize("forced,rows", [(0, None), (24, 24)])
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
