"""`ASYNCPP_PROFILE_DIR` under the launcher: the engine and every stage write a CPU profile of their loop."""

from __future__ import annotations

import pstats

from asyncpp.client import AsyncClient
from asyncpp.profiling import ENV_VAR
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_prompts
from tests.runtime.harness import launched, tiny_sections


async def test_engine_and_stages_write_profiles(tmp_path, tiny_hf_dir, monkeypatch):
    prof_dir = tmp_path / "prof"
    monkeypatch.setenv(ENV_VAR, str(prof_dir))  # the launcher and its spawned stages inherit it
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with launched(tmp_path, tiny_sections(tiny_hf_dir, 2, (2, 2))) as engine:
        client = AsyncClient(engine.address)
        try:
            stats = await client.stats()
            async for _ in client.generate(tiny_prompts(320, 1)[0][:40], params):
                pass
        finally:
            client.close()
    assert engine.proc.returncode == 0
    stage_pids = stats["stage_pids"]
    expected = {f"stage{rank}-{pid}.prof" for rank, pid in enumerate(stage_pids)}
    names = {p.name for p in prof_dir.iterdir()}
    assert expected <= names and any(n.startswith("engine-") for n in names), names
    for rank, pid in enumerate(stage_pids):
        functions = {func[2] for func in pstats.Stats(str(prof_dir / f"stage{rank}-{pid}.prof")).stats}
        assert "execute_model" in functions  # the profile covers the stage's steps
