"""The memory check before a deployment starts (`asyncpp.host_memory`): its floor, its boundary, what it skips,
and the launcher's exit 2 for one engine and for replicas."""

from __future__ import annotations

import time

import pytest

from asyncpp import launch
from asyncpp.bench.runs import to_toml
from asyncpp.config import ConfigError
from asyncpp.gguf_file import GGUFFile
from asyncpp.host_memory import MIB, check_host_memory, mem_available_bytes, weights_floor_bytes
from asyncpp.model_files import default_gguf_path
from asyncpp.weights import read_arch
from tests.conftest import tiny_config
from tests.runtime.harness import tiny_sections
from tests.weights.weights_helpers import GGUF_ARCH, Q, random_hf_tensors, write_llama_gguf

HUGE_KV_MB = 1 << 30  # a PiB of KV cache per stage: more than any host has


def test_mem_available_is_read_from_meminfo_in_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12345 kB\nBuffers: 7 kB\n")
    assert mem_available_bytes(str(meminfo)) == 12345 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert mem_available_bytes(str(meminfo)) is None
    meminfo.write_text("MemAvailable: lots\n")
    assert mem_available_bytes(str(meminfo)) is None
    assert mem_available_bytes(str(tmp_path / "missing")) is None
    assert mem_available_bytes() > 0  # this host's


def test_the_weights_floor_is_the_fewest_bytes_the_weights_can_take(tiny_hf_dir):
    config = tiny_config(tiny_hf_dir)  # float32 floats
    arch = read_arch("hf", str(tiny_hf_dir))
    params = arch.num_layers * arch.layer_params + arch.vocab_size * arch.hidden_size
    assert weights_floor_bytes(config, arch) == 4 * params
    for dtype in ("bfloat16", "float16", "auto"):
        assert weights_floor_bytes(tiny_config(tiny_hf_dir, model={"dtype": dtype}), arch) == 2 * params


def test_a_gguf_files_floor_is_its_tensors_bytes_unless_its_weights_become_floats(tmp_path, tiny_hf_dir):
    arch = GGUF_ARCH
    params = arch.num_layers * arch.layer_params + arch.vocab_size * arch.hidden_size
    quantized = write_llama_gguf(tmp_path / "q8.gguf", arch, random_hf_tensors(arch), Q.Q8_0)
    stored = sum(t.num_bytes for t in GGUFFile(quantized).tensors.values())
    assert stored < 2 * params and stored != sum(t.num_bytes for t in GGUFFile(default_gguf_path()).tensors.values())
    model = {"source": "gguf", "path": str(quantized), "dtype": "bfloat16"}
    for weight_format in ("auto", "native"):
        config = tiny_config(tiny_hf_dir, model={**model, "weight_format": weight_format})
        assert weights_floor_bytes(config, arch) == stored
    assert weights_floor_bytes(tiny_config(tiny_hf_dir, model={**model, "weight_format": "float"}), arch) == 2 * params
    floats = write_llama_gguf(tmp_path / "f32.gguf", arch, random_hf_tensors(arch))  # more bytes than bfloat16 takes
    assert weights_floor_bytes(tiny_config(tiny_hf_dir, model={**model, "path": str(floats)}), arch) == 2 * params


def test_the_check_refuses_one_byte_short_and_says_what_to_change(tiny_hf_dir):
    config = tiny_config(tiny_hf_dir, cache={"kv_cache_memory_mb": 3})
    arch = read_arch("hf", str(tiny_hf_dir))
    weights = weights_floor_bytes(config, arch)
    need = 3 * weights + 4 * 3 * MIB  # replicas of 1 and 1 stage, a long-prompt engine of 2
    check_host_memory(config, arch, [1, 1, 2], available=need)
    with pytest.raises(ConfigError) as refused:
        check_host_memory(config, arch, [1, 1, 2], available=need - 3 * MIB)
    assert str(refused.value) == (
        f"this deployment needs at least {need / MIB:,.0f} MiB of memory and {need / MIB - 3:,.0f} MiB are available: "
        f"3 copies of the weights (one per engine), at least {weights / MIB:,.0f} MiB each, and 4 stages' KV caches "
        "of 3 MiB each (cache.kv_cache_memory_mb); serve one engine instead (`asyncpp serve -dp 1 -pp 2`: "
        "parallel.dp_size = 1, pp_size = 2), or lower cache.kv_cache_memory_mb"
    )
    with pytest.raises(ConfigError, match=r"available: 2 copies of the weights \(one per engine\), .* serve one engine"):
        check_host_memory(config, arch, [1, 1], available=2 * weights + 2 * 3 * MIB - 1)
    check_host_memory(config, arch, [2], available=weights + 2 * 3 * MIB)  # its two stages split one copy
    with pytest.raises(ConfigError, match=r"available: the weights, at least .* 2 stages' KV caches of 3 MiB each "
                       r"\(cache.kv_cache_memory_mb\); lower cache.kv_cache_memory_mb, or serve a smaller model$"):  # fmt: skip
        check_host_memory(config, arch, [2], available=weights + 2 * 3 * MIB - 1)


def test_what_the_check_leaves_out(tiny_hf_dir):
    arch = read_arch("hf", str(tiny_hf_dir))
    overridden = tiny_config(tiny_hf_dir, cache={"kv_cache_memory_mb": HUGE_KV_MB, "num_kv_blocks_override": 8})
    weights = weights_floor_bytes(overridden, arch)
    check_host_memory(overridden, arch, [1, 1], available=2 * weights)  # blocks, not the budget: no KV counted
    with pytest.raises(ConfigError):
        check_host_memory(overridden, arch, [1, 1], available=2 * weights - 1)
    huge = {"cache": {"kv_cache_memory_mb": HUGE_KV_MB}}
    check_host_memory(tiny_config(tiny_hf_dir, model={"device": "cuda"}, **huge), arch, [1], available=1)
    check_host_memory(tiny_config(tiny_hf_dir, parallel={"backend": "ray"}, **huge), arch, [1], available=1)
    with pytest.raises(ConfigError):
        check_host_memory(tiny_config(tiny_hf_dir, **huge), arch, [1])  # this host's MemAvailable


def _launch(tmp_path, sections, capsys) -> str:
    config = tmp_path / "big.toml"
    config.write_text(to_toml(sections))
    t0 = time.monotonic()
    assert launch.main(["--config", str(config), "--log-level", "info"]) == 2
    assert time.monotonic() - t0 < 10.0
    return capsys.readouterr().err


def test_an_engine_that_cannot_fit_exits_2_before_its_stages_start(tmp_path, tiny_hf_dir, capsys):
    err = _launch(tmp_path, tiny_sections(tiny_hf_dir, 2, cache={"kv_cache_memory_mb": HUGE_KV_MB}), capsys)
    assert "error: this deployment needs at least" in err and "2 stages' KV caches" in err, err
    assert "compute_plan" not in err and "Traceback" not in err, err


def test_replicas_that_cannot_fit_exit_2_before_any_starts(tmp_path, tiny_hf_dir, capsys):
    sections = tiny_sections(tiny_hf_dir, 1, cache={"kv_cache_memory_mb": HUGE_KV_MB})
    sections["parallel"].update(dp_size=2, long_prompt_pp_size=2)
    err = _launch(tmp_path, sections, capsys)
    assert "error: this deployment needs at least" in err and "3 copies of the weights" in err, err
    assert "4 stages' KV caches" in err and "engine_started" not in err and "Traceback" not in err, err
