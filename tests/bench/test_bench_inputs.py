"""Run specs, per-run TOML files and benchmark requests."""

from __future__ import annotations

import json
import tomllib

import pytest

from asyncpp.bench.datasets import length_range, load_dataset, random_requests
from asyncpp.bench.runs import parse_runs, run_sections, to_toml, validate

BASE = """
[model]
source = "random"
path = "tiny-llama"

[parallel]
pp_size = 2
layer_split = [1, 3]
num_threads = 1

[server]
port = 5557
"""


def test_parse_runs_aliases_and_dotted_keys():
    runs = parse_runs("pp=2,threads=1; pp=1,scheduler.max_num_seqs=8 ;pp=2,parallel.layer_split=[3,1]")
    assert [r.label for r in runs] == ["pp=2,threads=1", "pp=1,scheduler.max_num_seqs=8", "pp=2,parallel.layer_split=[3,1]"]
    assert runs[0].overrides == (("parallel.pp_size", 2), ("parallel.num_threads", 1))
    assert runs[1].overrides[1] == ("scheduler.max_num_seqs", 8)
    assert runs[2].overrides[1] == ("parallel.layer_split", [3, 1])
    assert parse_runs(None)[0].overrides == ()


@pytest.mark.parametrize("bad", ["pp", "pp=2;pp=2", "bogus=1", "a.b.c=1"])
def test_parse_runs_rejects(bad):
    with pytest.raises(ValueError):
        parse_runs(bad)


def test_run_sections_override_and_pick_any_port(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text(BASE)
    one = run_sections(base, parse_runs("pp=1,threads=2")[0])
    assert one["parallel"] == {"pp_size": 1, "dp_size": 1, "layer_split": [], "num_threads": 2}  # the pp=2 split is dropped
    assert one["server"]["port"] == 0
    two = run_sections(base, parse_runs("pp=2")[0])
    assert two["parallel"]["layer_split"] == [1, 3]
    again = tomllib.loads(to_toml(one))
    assert again == one
    config = validate(again)
    assert config.parallel.pp_size == 1 and config.parallel.num_threads == 2 and config.server.port == 0


def test_pipeline_stages_alone_make_one_engine_on_a_base_with_replicas(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text("[parallel]\npp_size = 1\ndp_size = 2\nlong_prompt_pp_size = 2\n")
    parallel = [run_sections(base, run)["parallel"] for run in parse_runs("pp=2;pp=2,dp=3;threads=2")]
    assert [(p["dp_size"], p["pp_size"]) for p in parallel] == [(1, 2), (3, 2), (2, 1)]


def test_random_requests_are_seeded_and_in_range():
    reqs = random_requests(200, 40, 20, range_ratio=0.5, seed=3)
    assert reqs == random_requests(200, 40, 20, range_ratio=0.5, seed=3)
    assert reqs != random_requests(200, 40, 20, range_ratio=0.5, seed=4)
    assert all(20 <= len(r.prompt.split()) <= 60 and 10 <= r.output_len <= 30 for r in reqs)
    fixed = random_requests(5, 16, 7)
    assert all(len(r.prompt.split()) == 16 and r.output_len == 7 for r in fixed)
    assert length_range(64, 0.0) == (64, 64)


def test_dataset_file(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [{"prompt": "hello there", "output_len": 5}, {"prompt": "no length"}, {"prompt": "third"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_dataset(path, num_prompts=2, default_output_len=9)
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello there", 5), ("no length", 9)]
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_dataset(path, 1, 9)
