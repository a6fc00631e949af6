"""A real pp=2 run's JSON log converts into a consistent Chrome trace and a PNG summary."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from asyncpp.trace.__main__ import main as trace_main
from tests.conftest import tiny_prompts
from tests.runtime.harness import launched, tiny_sections


async def _run_requests(address: str) -> None:
    client = AsyncClient(address)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def one(prompt):
        async for _ in client.generate(prompt, params):
            pass

    try:
        await asyncio.gather(*(one(p) for p in tiny_prompts(320, 12)))
    finally:
        client.close()


def test_real_pp2_log_to_trace(tmp_path, tiny_hf_dir):
    with launched(tmp_path, tiny_sections(tiny_hf_dir, pp_size=2)) as engine:
        asyncio.run(_run_requests(engine.address))
        log_file = engine.log_file
    out, png = tmp_path / "trace.json", tmp_path / "summary.png"
    assert trace_main([str(log_file), "-o", str(out), "--png", str(png)]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]

    dispatched = set()
    for line in log_file.read_text().splitlines():
        record = json.loads(line)  # every line the engine writes is valid JSON
        if record.get("event") == "step_dispatched":
            dispatched.add(record["step_id"])
    assert dispatched, "the run dispatched no steps"

    slices = [e for e in events if e.get("ph") == "X" and e.get("cat") == "stage"]
    by_stage: dict[int, dict[int, dict]] = defaultdict(dict)
    for e in slices:
        by_stage[e["pid"]][e["args"]["step_id"]] = e
    assert len(by_stage) == 2
    for steps in by_stage.values():  # every step appears on every stage
        assert set(steps) == dispatched

    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in (e for e in events if e.get("ph") == "X"):
        tracks[(e["pid"], e["tid"])].append(e)
    for track in tracks.values():  # no overlap within a track
        track.sort(key=lambda e: e["ts"])
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"]

    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    finishes = {e["id"]: e for e in events if e.get("ph") == "f"}
    assert set(starts) == set(finishes) and len(starts) == len(dispatched)
    stage0, stage1 = sorted(by_stage)
    for flow_id, s in starts.items():  # each flow links stage 0 -> stage 1 of one step
        f = finishes[flow_id]
        assert (s["pid"], f["pid"]) == (stage0, stage1)
        src = next(e for e in by_stage[stage0].values() if e["ts"] <= s["ts"] <= e["ts"] + e["dur"])
        dst = next(e for e in by_stage[stage1].values() if e["ts"] <= f["ts"] <= e["ts"] + e["dur"])
        assert src["args"]["step_id"] == dst["args"]["step_id"]
        assert dst["ts"] >= src["ts"] + src["dur"] - 1  # the next stage starts after the hand-off

    assert any(e.get("ph") == "C" for e in events)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
