"""`python -m asyncpp.bench.linears_ab`: two builds of the kernel timed in one process, in turn."""

from pathlib import Path

import pytest

from asyncpp.kernels.isa import cpu_info

pytestmark = pytest.mark.skipif(not cpu_info().supports("avx512_bf16"), reason="the kernel needs AVX512-BF16")


def test_two_versions_are_timed_against_the_first(capsys, monkeypatch):
    from asyncpp.bench import linears_ab

    root = Path(__file__).resolve().parents[2]
    # Two of the model's 121 linears keep the test short; the bench runs them all.
    all_linears = linears_ab._linears
    monkeypatch.setattr(linears_ab, "_linears", lambda: all_linears()[:2])
    built = []
    load = linears_ab.load_version
    monkeypatch.setattr(linears_ab, "load_version", lambda *a: built.append(load(*a)) or built[-1])
    assert linears_ab.main([str(root), str(root), "--rows", "17", "--repeats", "2", "--fma"]) == 0
    assert len(built) == 1  # one tree named twice is built once
    assert built[0].kernel.fma_min_rows() == (1, 1)  # --fma: the FMA path from one row on
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]
    assert len(lines) == 2
    assert lines[0].endswith("median time 1.000x the first's")
    assert all(" GMAC/s" in line and str(root) in line for line in lines)
    rates = [float(line.split(key)[1].split()[0]) for line in lines for key in (" best ", " median ")]
    assert all(1.0 < r < 1000.0 for r in rates)  # multiply-accumulates per second, not a ratio of them


def test_formats_keeps_the_linears_of_those_formats_only(capsys, monkeypatch):
    from asyncpp.bench import linears_ab

    root = Path(__file__).resolve().parents[2]
    every = linears_ab._linears()
    picked = [every[0], every[-1]]  # a Q4_1 linear and the Q8_0 head, loaded once
    monkeypatch.setattr(linears_ab, "_linears", lambda: picked)
    head = picked[-1][0]
    formats, built = [], []
    load = linears_ab.load_version

    def spied(*args):
        kernel = load(*args)
        linear = kernel.linear
        kernel.linear = lambda fmt, *a, **kw: formats.append(fmt) or linear(fmt, *a, **kw)
        built.append(kernel)
        return kernel

    monkeypatch.setattr(linears_ab, "load_version", spied)
    clock = iter(range(1_000_000))  # every reading one second after the last: each pass takes 1 s
    monkeypatch.setattr(linears_ab.time, "perf_counter", lambda: float(next(clock)))
    argv = [str(root), "--rows", "2,3", "--repeats", "2", "--formats", "q5_k,q8_0"]
    assert linears_ab.main(argv) == 0
    assert formats == ["q8_0"] * 2 * 3  # the head alone, a warm-up pass and 2 repeats per row count
    assert built[0].kernel.fma_min_rows() == (None, None)  # without --fma: vdpbf16ps at every row count
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]
    assert [line.split()[1] for line in lines] == ["2", "3"]
    macs = head.shape[0] * head.shape[1]
    for line, rows in zip(lines, (2, 3)):
        assert f"best {macs * rows / 1e9:6.1f} median {macs * rows / 1e9:6.1f} GMAC/s" in line
    with pytest.raises(SystemExit):
        linears_ab.main([str(root), "--rows", "2", "--repeats", "1", "--formats", "q5_k"])
    assert "no linear of the model is in ['q5_k']" in capsys.readouterr().err
