"""The README's run command: launch the default config (real SmolLM2: two replicas and a two-stage
pipeline), stream one answer, exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"


def test_one_shot_streams_a_real_answer_and_exits_zero(tmp_path):
    log_file = tmp_path / "one-shot.jsonl"
    cmd = [
        sys.executable, "-m", "asyncpp.launch", "--config", str(DEFAULT_CONFIG), "--port", "0",
        "--prompt", "What is the capital of France?", "--max-tokens", "32", "--log-file", str(log_file),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Paris" in done.stdout, done.stdout + done.stderr
    assert '"engine_ready"' in log_file.read_text()  # a log file gets info events, even in one-shot mode
