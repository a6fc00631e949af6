"""The KV connector in the launched runtime: every stage process binds, polls and clears every step;
bad connector settings fail at start-up naming their key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncpp.bench.runs import to_toml
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect_all
from tests.runtime.harness import launched, tiny_sections

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def test_every_stage_process_polls_its_connector_on_every_step(tmp_path, tiny_hf_dir):
    prompts = tiny_prompts(320, 6)
    reference = [c.token_ids for c in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    kv = {
        "connector": "recording",
        "module": "tests.kv_transfer.connectors",
        "options": {"load_blocks": 1, "delay_steps": 30, "events_dir": str(events_dir)},
    }
    with launched(tmp_path, tiny_sections(tiny_hf_dir, 3, (1, 1, 2), kv_transfer=kv)) as engine:
        results, stats = await collect_all(engine.address, prompts, GREEDY)
    assert [r[0] for r in results] == reference  # the failed loads were recomputed
    assert stats["kv_connector"] == "recording"
    assert stats["num_failed_load_tokens"] > 0 and stats["num_external_prefix_hit_tokens"] == 0
    steps: dict[int, dict[int, list[str]]] = {}
    for path in events_dir.glob("stage*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] != "register_kv_caches" and e["event"] != "reported":
                steps.setdefault(e["pp_rank"], {}).setdefault(e["step_id"], []).append(e["event"])
    assert sorted(steps) == [0, 1, 2]
    assert steps[0].keys() == steps[1].keys() == steps[2].keys()
    num_polls = 0
    for step_id, events in steps[0].items():
        has_forward = "save_kv" in events
        num_polls += not has_forward
        for rank in range(3):
            expected = ["bind", "start_load_kv"] + (["save_kv", "wait_for_save"] if has_forward else [])
            assert steps[rank][step_id] == expected + ["get_finished", "clear"], (rank, step_id)
    assert num_polls > 0  # loads outlived the short requests: the idle engine kept polling


def _launch_exit(tmp_path, sections) -> subprocess.CompletedProcess:
    config = tmp_path / "bad.toml"
    config.write_text(to_toml(sections))
    return subprocess.run(
        [sys.executable, "-m", "asyncpp.launch", "--config", str(config)],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    "kv,key",
    [
        ({"connector": "no-such-connector"}, "kv_transfer.connector"),
        ({"connector": "offload", "store_size_mb": 0}, "kv_transfer.store_size_mb"),
        ({"connector": "offload", "store_size_mb": -5}, "kv_transfer.store_size_mb"),
        ({"connector": "offload", "store": "dir"}, "kv_transfer.store_path"),
        ({"connector": "multi", "children": [{"connector": "nope"}]}, "kv_transfer.children[0].connector"),
        ({"connector": "none", "module": "tests.no_such_module"}, "kv_transfer.module"),
    ],
)
def test_bad_connector_config_fails_at_start_up_naming_the_key(tmp_path, tiny_hf_dir, kv, key):
    done = _launch_exit(tmp_path, tiny_sections(tiny_hf_dir, 2, (2, 2), kv_transfer=kv))
    assert done.returncode == 2, done.stderr
    assert key in done.stderr


def test_unwritable_store_directory_fails_at_start_up(tmp_path, tiny_hf_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    kv = {"connector": "offload", "store": "dir", "store_path": str(blocker / "store")}
    done = _launch_exit(tmp_path, tiny_sections(tiny_hf_dir, 2, (2, 2), kv_transfer=kv))
    assert done.returncode == 2, done.stderr
    assert "kv_transfer.store_path" in done.stderr and str(blocker) in done.stderr
