"""The default deployment's pipeline (the real SmolLM2, pp=2, the engine its long prompts go to) with only
`parallel.backend = "ray"` set starts on two simulated Ray nodes (NIXL over TCP; layer shifting, auto, turns
itself off) and answers token for token as the same config in process (where the layers shift: the same bits
either way)."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncpp.client import AsyncClient
from asyncpp.config import config_from_dict
from asyncpp.engine.engine import Engine
from tests.conftest import default_pipeline_sections
from tests.runtime.conftest import collect
from tests.runtime.harness import launched
from tests.runtime.ray_backend.conftest import placed_event
from tests.runtime.test_real_model_pp import CHATS, GREEDY


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


def _auto_shift(log_file) -> list[dict]:
    """The launcher's `shift_layers_auto` events: what auto came to, and why."""
    return [json.loads(line) for line in log_file.read_text().splitlines() if '"shift_layers_auto"' in line]


def _default_sections() -> dict:
    return default_pipeline_sections()  # the default deployment's two stages, on any free port


async def test_the_default_pipeline_on_two_ray_nodes_equals_local(tmp_path, ray_cluster):
    local_config = config_from_dict(_default_sections())
    assert local_config.shift_layers == 4  # in process, the layers shift
    local = [c.token_ids for c in Engine(local_config).generate(CHATS, GREEDY)]
    sections = _default_sections()
    sections["parallel"] |= {"backend": "ray", "ray_address": ray_cluster.address}
    on_ray, log_file = await _chats(tmp_path / "ray", sections)
    assert placed_event(log_file)["transports"] == ["nixl"]
    assert [(e["shift_layers"], "Ray" in e["reason"]) for e in _auto_shift(log_file)] == [(0, True)]
    for chat, tokens, (ray_tokens, text, _) in zip(CHATS, local, on_ray):
        assert ray_tokens == tokens, chat
        assert len(tokens) > 0 and text
