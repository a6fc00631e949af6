"""`python -m asyncpp.bench.fused_ops_ab`: builds of the fused ops timed in one process, in turn."""

from pathlib import Path

import pytest

from asyncpp.bench import fused_ops_ab
from asyncpp.kernels.build import find_compiler

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
ROOT = Path(__file__).resolve().parents[2]


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_op_is_timed_against_the_first_version(capsys, monkeypatch, dtype):
    built = []
    load = fused_ops_ab.load_version
    monkeypatch.setattr(fused_ops_ab, "load_version", lambda *a: built.append(load(*a)) or built[-1])
    assert fused_ops_ab.main([str(ROOT), str(ROOT), "--rows", "3,17", "--repeats", "2", "--level", "generic",
                              "--dtype", dtype]) == 0  # fmt: skip
    assert len(built) == 1  # one tree named twice is built once
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"fused ops at level generic, {dtype}, one thread")
    lines = [line for line in out.splitlines() if line.startswith("rows")]
    assert [line.split()[2] for line in lines] == ["add_rms_norm", "silu_mul", "rope"] * 2
    assert [line.split()[1] for line in lines] == ["3"] * 3 + ["17"] * 3
    for line in lines:
        assert line.endswith("same bits")
        first, second = line.split(" us ")[1:3]
        assert first.startswith("1.000x") and second.split()[0].endswith("x")
        assert 0.0 < float(line.split()[3]) < 20_000.0  # microseconds a call (these ops take a few to 100s)


def test_versions_that_write_other_bits_are_flagged(capsys, tmp_path):
    kernels = tmp_path / "asyncpp" / "kernels"
    kernels.mkdir(parents=True)
    for f in (ROOT / "asyncpp" / "kernels").glob("*.h"):
        (kernels / f.name).write_bytes(f.read_bytes())
    source = (ROOT / "asyncpp" / "kernels" / "fused_ops.c").read_text()
    # A RoPE that skips the sine term: other bits for rope only.
    rotated = "xh[j] = narrow(round_bf16(lo * c[j]) + round_bf16(-hi * s[j]));"
    assert rotated in source
    (kernels / "fused_ops.c").write_text(source.replace(rotated, "xh[j] = narrow(round_bf16(lo * c[j]));"))
    assert fused_ops_ab.main([str(ROOT), str(tmp_path), "--rows", "4", "--repeats", "1", "--level", "generic"]) == 0
    verdicts = {line.split()[2]: line.split("   ")[-1] for line in _lines(capsys)}
    assert verdicts == {"add_rms_norm": "same bits", "silu_mul": "same bits", "rope": "BITS DIFFER"}
