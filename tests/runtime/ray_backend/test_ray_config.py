"""Bad Ray configuration fails at start-up with an error naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncpp.bench.runs import to_toml
from asyncpp.config import ConfigError, ParallelConfig
from asyncpp.runtime.ray_backend import placement
from tests.runtime.harness import tiny_sections
from tests.runtime.ray_backend.conftest import placement_groups_alive, ray_sections


def _launch_error(tmp_path, sections) -> str:
    config = tmp_path / "engine.toml"
    config.write_text(to_toml(sections))
    proc = subprocess.run(
        [sys.executable, "-m", "asyncpp.launch", "--config", str(config)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr


@pytest.mark.parametrize(
    "fields,key",
    [
        ({"backend": "mpi"}, "parallel.backend"),
        ({"backend": "ray", "placement": "scatter"}, "parallel.placement"),
        ({"backend": "ray", "ray_address": ""}, "parallel.ray_address"),
        ({"backend": "ray", "pp_size": 2, "shift_layers": 1}, "parallel.shift_layers"),
    ],
)
def test_bad_fields_name_their_key(fields, key):
    with pytest.raises(ConfigError, match=key):
        ParallelConfig(**fields)


def test_no_ray_installed_names_the_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ConfigError, match=r"parallel.backend = 'ray' needs Ray"):
        placement.import_ray()


def test_an_unreachable_cluster_names_the_address(tmp_path, tiny_hf_dir):
    sections = tiny_sections(tiny_hf_dir, 2, (), parallel={"backend": "ray", "ray_address": "127.0.0.1:1"})
    assert "parallel.ray_address '127.0.0.1:1' is unreachable" in _launch_error(tmp_path, sections)


def test_more_stages_than_the_cluster_holds(tmp_path, tiny_hf_dir, ray_cluster):
    sections = tiny_sections(tiny_hf_dir, 4, (), **ray_sections(ray_cluster))  # 3 one-CPU nodes
    assert "parallel.pp_size: 4 stages need 4 CPU" in _launch_error(tmp_path, sections)
    assert placement_groups_alive() == []


def test_a_gpu_no_node_has(ray_cluster):
    with pytest.raises(ConfigError, match="model.device: 2 stages need 2 GPU"):
        placement.reserve(["cuda:0", "cuda:0"], 1, "spread", "asyncpp-test-gpu")


def test_bundles_that_fit_no_node_together(ray_cluster):
    # 3 CPUs in the cluster, but no node has 2: Ray cannot place a 2-CPU bundle.
    placement.PLACEMENT_TIMEOUT_S, saved = 1.0, placement.PLACEMENT_TIMEOUT_S
    try:
        with pytest.raises(ConfigError, match="parallel.placement = 'pack': Ray could not place"):
            placement.reserve(["cpu"], 2, "pack", "asyncpp-test-unplaceable")
    finally:
        placement.PLACEMENT_TIMEOUT_S = saved
    assert placement_groups_alive() == []
