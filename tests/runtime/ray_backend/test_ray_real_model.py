"""The real SmolLM2 at pp=2 on two simulated Ray nodes (NIXL over TCP) answers token for token as local pp=2."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from tests.runtime.conftest import collect
from tests.runtime.harness import launched
from tests.runtime.ray_backend.conftest import placed_event, ray_sections
from tests.runtime.test_real_model_pp import CHATS, GREEDY, real_sections

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
]


async def _chats(run_dir, sections) -> list:
    run_dir.mkdir()
    with launched(run_dir, sections, ready_timeout_s=300) as engine:
        client = AsyncClient(engine.address)
        try:
            results = await asyncio.wait_for(asyncio.gather(*(collect(client, c, GREEDY) for c in CHATS)), 180)
        finally:
            client.close()
    assert engine.proc.returncode == 0, "".join(engine.output[-30:])
    return results, engine.log_file


async def test_real_model_on_two_ray_nodes_equals_local(tmp_path, ray_cluster):
    local, _ = await _chats(tmp_path / "local", real_sections(2))
    sections = real_sections(2)
    sections["parallel"].update(ray_sections(ray_cluster)["parallel"])
    on_ray, log_file = await _chats(tmp_path / "ray", sections)
    assert placed_event(log_file)["transports"] == ["nixl"]
    for chat, one, two in zip(CHATS, local, on_ray):
        assert two[0] == one[0], chat
        assert two[1] == one[1] and len(one[0]) > 0
