"""The launched engine shows its compute plan (ready line, log, stats) and gives it to every stage.

A level below the CPU's best also caps torch's own kernels in the stage
processes (`torch_isa_env` in their environment), and only there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from asyncpp.client import AsyncClient
from asyncpp.kernels.isa import cpu_info, torch_isa_env
from asyncpp.runtime.stage_group import _environ
from tests.runtime.harness import launched, tiny_sections

PLAN_KEYS = {"cpu_model", "isa", "best_isa", "dtype", "weight_format", "reason", "cpu_features", "attention"}


def ready_line(output: list[str]) -> str:
    return next(line for line in output if "asyncpp ready:" in line)


def events(log_file: Path, name: str) -> list[dict]:
    """The JSON log records of event `name` (a line being written right now is skipped)."""
    found = []
    for line in log_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == name:
            found.append(record)
    return found


async def test_stats_and_ready_line_show_the_plan(shared_pp2_engine):
    client = AsyncClient(shared_pp2_engine.address)
    try:
        stats = await client.stats()
    finally:
        client.close()
    assert PLAN_KEYS <= set(stats)
    best = cpu_info().best_level
    assert (stats["isa"], stats["best_isa"], stats["dtype"], stats["weight_format"]) == (best, best, "float32", "native")
    assert stats["reason"] == "float32: set by model.dtype" and stats["cpu_model"] == cpu_info().model_name
    weights = stats["weight_bytes_per_stage"]
    assert len(weights) == 2 and all(type(n) is int and n > 0 for n in weights), weights
    line = ready_line(shared_pp2_engine.output)
    # the tiny model's float32 caches: the attention kernel's float32 arithmetic, named in stats and the line
    assert stats["attention"] == "float32 multiplies"
    assert f"(cpu: {best} of {best}; dtype float32: set by model.dtype; weights native; attention float32 multiplies)" in line, line
    [event] = events(shared_pp2_engine.log_file, "compute_plan")
    assert {k: event[k] for k in PLAN_KEYS} == {k: stats[k] for k in PLAN_KEYS}


@pytest.mark.skipif(
    not cpu_info().supports("avx2") or cpu_info().best_level == "avx2", reason="needs a CPU above avx2"
)
async def test_a_forced_level_reaches_the_stages_and_caps_torch_there(tmp_path, tiny_hf_dir):
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), model={"dtype": "auto", "cpu_isa": "avx2"})
    with launched(tmp_path, sections) as engine:
        client = AsyncClient(engine.address)
        try:
            stats = await client.stats()
        finally:
            client.close()
        environs = [_environ_of(pid) for pid in stats["stage_pids"]]
    assert engine.proc.returncode == 0
    # No native bfloat16 at avx2: "auto" is float32, and the KV cache was sized for it.
    assert (stats["isa"], stats["best_isa"], stats["dtype"]) == ("avx2", cpu_info().best_level, "float32")
    assert "cpu_isa = avx2" in stats["reason"]
    assert "(cpu: avx2 of " in ready_line(engine.output)
    expected = torch_isa_env("avx2")
    assert expected["ATEN_CPU_CAPABILITY"] == "avx2"
    for env in environs:
        assert {k: env.get(k) for k in expected} == expected
    stage_events = events(engine.log_file, "stage_ready")
    assert sorted(r["isa"] for r in stage_events) == ["avx2", "avx2"]
    assert all(r["dtype"] == "float32" and r["weight_nbytes"] > 0 for r in stage_events)


def test_environ_is_set_for_the_block_only(monkeypatch):
    monkeypatch.setenv("ASYNCPP_TEST_KEPT", "before")
    monkeypatch.delenv("ASYNCPP_TEST_NEW", raising=False)
    with _environ({"ASYNCPP_TEST_KEPT": "inside", "ASYNCPP_TEST_NEW": "1"}):
        assert os.environ["ASYNCPP_TEST_KEPT"] == "inside" and os.environ["ASYNCPP_TEST_NEW"] == "1"
    assert os.environ["ASYNCPP_TEST_KEPT"] == "before" and "ASYNCPP_TEST_NEW" not in os.environ


def _environ_of(pid: int) -> dict[str, str]:
    """A process's environment as it was exec'd (/proc/PID/environ)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)
