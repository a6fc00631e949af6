"""The launcher resolves the compute plan before anything starts: a bad one is exit code 2 and one sentence."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncpp import launch
from asyncpp.bench.runs import to_toml
from asyncpp.kernels import isa
from asyncpp.kernels.isa import CpuInfo
from tests.runtime.harness import tiny_sections

AVX2_ONLY = CpuInfo("Intel(R) Core(TM) i7-4770", frozenset({"sse4_2", "avx2", "fma", "f16c"}), "x86_64")


def write_config(tmp_path, tiny_hf_dir, **model):
    path = tmp_path / "engine.toml"
    path.write_text(to_toml(tiny_sections(tiny_hf_dir, 2, (2, 2), model=model)))
    return path


@pytest.mark.parametrize(
    "model,words",
    [
        ({"cpu_isa": "avx512"}, "model.cpu_isa = 'avx512' but this CPU (Intel(R) Core(TM) i7-4770) runs at most 'avx2'"),
        ({"weight_format": "native", "dtype": "bfloat16"}, "model.dtype"),
    ],
)
def test_launcher_exits_2_naming_the_key(tmp_path, tiny_hf_dir, monkeypatch, capsys, model, words):
    monkeypatch.setattr(isa, "cpu_info", lambda: AVX2_ONLY)  # the machine the plan is resolved for
    config = write_config(tmp_path, tiny_hf_dir, **model)
    assert launch.main(["--config", str(config), "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and words in err, err
    assert "Traceback" not in err and "stage_ready" not in err


def test_unknown_level_in_the_file_exits_2(tmp_path, tiny_hf_dir, capsys):
    config = write_config(tmp_path, tiny_hf_dir, cpu_isa="avx3")
    assert launch.main(["--config", str(config)]) == 2
    assert "model.cpu_isa must be one of" in capsys.readouterr().err


@pytest.mark.skipif(isa.cpu_info().supports("amx"), reason="this CPU has AMX")
def test_launcher_process_exits_2_for_a_level_this_cpu_lacks(tmp_path, tiny_hf_dir):
    config = write_config(tmp_path, tiny_hf_dir, cpu_isa="amx")
    done = subprocess.run(
        [sys.executable, "-m", "asyncpp.launch", "--config", str(config)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "error: model.cpu_isa = 'amx' but this CPU" in done.stderr
    assert "stage_ready" not in done.stderr and "Traceback" not in done.stderr
