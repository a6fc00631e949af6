"""Stage devices: config validation, and a clear start-up error where CUDA is asked for but absent."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from asyncpp.bench.runs import to_toml
from asyncpp.config import ConfigError, config_from_dict
from asyncpp.engine.engine import Engine
from tests.conftest import tiny_config
from tests.runtime.harness import tiny_sections

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


def test_stage_devices_default_to_the_model_device():
    config = config_from_dict({"model": {"device": "cuda"}, "parallel": {"pp_size": 3}})
    assert config.stage_devices == ("cuda", "cuda", "cuda")
    config = config_from_dict({"model": {"device": "cuda"}, "parallel": {"pp_size": 2, "devices": ["cuda:0", "cuda:1"]}})
    assert config.stage_devices == ("cuda:0", "cuda:1")
    assert config_from_dict({}).stage_devices == ("cpu",)


@pytest.mark.parametrize(
    "sections,words",
    [
        ({"parallel": {"pp_size": 2, "devices": ["cuda:0"]}}, "parallel.devices has 1 entries"),
        ({"parallel": {"pp_size": 2, "devices": ["cuda:0", "gpu:1"]}}, "parallel.devices entries"),
        ({"model": {"device": "cuda"}, "parallel": {"pp_size": 2, "devices": ["cuda:0", "cpu"]}}, "mixes device kinds"),
        ({"model": {"device": "cpu"}, "parallel": {"pp_size": 2, "devices": ["cuda:0", "cuda:1"]}}, "do not match model.device"),
        ({"model": {"device": "cuda:x"}}, "model.device"),
        ({"model": {"cuda_graph_sizes": [4, 2]}}, "model.cuda_graph_sizes must be increasing"),
        ({"model": {"cuda_graph_sizes": [0, 2]}}, "model.cuda_graph_sizes entries"),
        ({"model": {"cuda_graphs": "yes"}}, "model.cuda_graphs must be bool"),
    ],
)
def test_bad_device_config_names_the_key(sections, words):
    with pytest.raises(ConfigError, match=words):
        config_from_dict(sections)


@no_cuda
def test_in_process_engine_on_cuda_without_a_gpu_fails_clearly(tiny_hf_dir):
    with pytest.raises(ConfigError, match=r"model.device asks for 'cuda' but (this torch .* is built without CUDA|no CUDA device)"):
        Engine(tiny_config(tiny_hf_dir, model={"device": "cuda"}))


@no_cuda
def test_launcher_on_cuda_without_a_gpu_exits_2_before_starting_stages(tmp_path, tiny_hf_dir):
    config = tmp_path / "cuda.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir, 2, (2, 2), model={"device": "cuda"}, parallel={"devices": ["cuda:0", "cuda:1"]})))
    done = subprocess.run(
        [sys.executable, "-m", "asyncpp.launch", "--config", str(config)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "parallel.devices asks for 'cuda:0'" in done.stderr
    assert "stage_ready" not in done.stderr and "Traceback" not in done.stderr
