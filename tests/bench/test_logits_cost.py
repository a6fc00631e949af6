"""The float32-logits cost benchmark: pairs of bfloat16 / float32 heads on the tiny model."""

from __future__ import annotations

import pytest

from asyncpp.bench.logits_cost import main
from asyncpp.bench.runs import to_toml
from asyncpp.kernels.linear_bf16 import bf16_native_kernel
from tests.runtime.harness import tiny_sections


def test_logits_cost_compares_the_two_heads(tmp_path, tiny_hf_dir, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir, model={"dtype": "bfloat16"})))
    code = main(["--config", str(config), "--batch-sizes", "1,3", "--num-steps", "8"])
    out = capsys.readouterr().out
    if bf16_native_kernel() is None:  # the qlinear head writes float32 only
        assert code == 1 and "cannot write both dtypes" in out
        pytest.skip("no AVX512-BF16 head here")
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 and row[3].endswith("x") for row in rows)


def test_a_float32_model_has_nothing_to_compare(tmp_path, tiny_hf_dir, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir)))
    assert main(["--config", str(config), "--batch-sizes", "1", "--num-steps", "4"]) == 1
    assert "nothing to compare" in capsys.readouterr().out
