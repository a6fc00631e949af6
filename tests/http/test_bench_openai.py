"""`python -m asyncpp.bench` through the OpenAI HTTP API: per run (`backend=openai`) and against a
server it did not launch (`--base-url`), with the same metrics as the native client."""

from __future__ import annotations

import json

import pytest

from asyncpp.bench import serve
from asyncpp.bench.runs import parse_runs
from tests.http.test_openai_server import MODEL
from tests.runtime.harness import tiny_sections, to_toml

NUM_PROMPTS = 10
OUTPUT_LEN = 6
ARGS = ["--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--random-input-len", "12",
        "--random-output-len", str(OUTPUT_LEN)]  # fmt: skip


def test_native_and_openai_runs_of_one_invocation(tmp_path, tiny_hf_dir):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir, 2)))
    out = tmp_path / "result.json"
    argv = ["--config", str(config), *ARGS, "--runs", "backend=native;backend=openai", "--result-json", str(out)]
    assert serve.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["backend"] for r in result["runs"]] == ["native", "openai"]
    for run in result["runs"]:
        m = run["metrics"]
        assert m["completed"] == NUM_PROMPTS and m["failed"] == 0
        assert m["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert m["mean_ttft_ms"] > 0 and m["mean_tpot_ms"] > 0
    # The same requests: the engine saw the same prompt tokens either way.
    assert result["runs"][0]["metrics"]["total_input_tokens"] == result["runs"][1]["metrics"]["total_input_tokens"]
    assert any(row["metric"] == "output_throughput" for row in result["ratios"])


def test_base_url_benchmarks_a_server_it_did_not_launch(tmp_path, openai_server, capsys):
    out = tmp_path / "ext.json"
    argv = ["--base-url", openai_server.base_url, *ARGS, "--result-json", str(out)]
    assert serve.main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["model"] == MODEL and run["metrics"]["completed"] == NUM_PROMPTS
    assert run["metrics"]["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert "Output token throughput" in capsys.readouterr().out


def test_backend_run_key_is_checked():
    (run,) = parse_runs("backend=http")
    with pytest.raises(ValueError, match="native or openai"):
        run.backend("native")
