"""A port in use stops a launch before the model loads: exit 2 and one line naming its key.

One launched engine holds both ports (its client port `server.port` and its
HTTP port); each case launches another on one of them, which must fail at
once, never disturb the holder (its next request is served, nothing held),
and never claim to serve what another process serves.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest

from asyncpp.bench.runs import to_toml
from tests.http.idle_checks import served_and_nothing_held
from tests.http.test_openai_server import free_port
from tests.runtime.harness import launched, tiny_sections

QUICK_S = 15.0  # the launcher's imports (torch) take most of it; loading the model and starting stages would take more
STAGE_EVENTS = ('"stage_ready"', '"stage_stopped"', '"engine_ready"')  # any stage that ran logs them


@pytest.fixture(scope="module")
def holder(tmp_path_factory, tiny_hf_dir):
    port, http_port = free_port(), free_port()
    sections = tiny_sections(tiny_hf_dir, 1, server={"port": port, "http_port": http_port})
    with launched(tmp_path_factory.mktemp("holder"), sections) as engine:
        engine.port, engine.http_port = port, http_port
        engine.base_url = f"http://127.0.0.1:{http_port}"
        yield engine


def launch(tmp_path, sections: dict, module: str = "asyncpp.launch", timeout_s: float = 180.0):
    """Run a launcher to its end: (exit code, its output, seconds it took, its log)."""
    config, log_file = tmp_path / "other.toml", tmp_path / "other.jsonl"
    config.write_text(to_toml(sections))
    cmd = [sys.executable, "-m", module, "--config", str(config), "--log-file", str(log_file), "--log-level", "debug"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    log = log_file.read_text() if log_file.exists() else ""
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0, log


def assert_refused(code: int, output: str, pattern: str) -> None:
    """Exit 2, one line matching `pattern` after "error: ", and no claim to serve."""
    assert code == 2, output
    assert any(re.fullmatch(f"error: {pattern}", line) for line in output.splitlines()), output
    assert "Traceback" not in output and "OpenAI API on" not in output and "asyncpp ready" not in output, output


@pytest.mark.parametrize("key,attr", [("http_port", "http_port"), ("port", "port")], ids=["http_port", "client_port"])
async def test_a_taken_port_is_exit_2_before_the_model_loads(holder, tmp_path, tiny_hf_dir, key, attr):
    async with asyncio.timeout(120):
        taken = getattr(holder, attr)
        code, output, took_s, log = launch(tmp_path, tiny_sections(tiny_hf_dir, 1, server={key: taken}))
        assert_refused(code, output, rf"server.{key} {taken} on 127\.0\.0\.1 is already in use")
        assert not any(event in log for event in STAGE_EVENTS), log
        assert took_s < QUICK_S
        print(f"\ntaken server.{key} refused in {took_s:.2f} s")
        await served_and_nothing_held(holder.base_url)


async def test_an_http_server_that_cannot_listen_fails_the_launch(holder, tmp_path, tiny_hf_dir):
    """Past the early check (skipped here), the launcher waits for its own server, not for the port
    to accept connections: another process there used to pass for it."""
    async with asyncio.timeout(240):
        sections = tiny_sections(tiny_hf_dir, 1, server={"http_port": holder.http_port})
        code, output, _, log = launch(tmp_path, sections, module="tests.runtime.unchecked_http_port_launch")
        pattern = (rf"server.http_port {holder.http_port} on 127\.0\.0\.1: the HTTP server exited with code \d+ "
                   r"before it listened \(its own lines above say why\)")  # fmt: skip
        assert_refused(code, output, pattern)
        assert "address already in use" in output, output  # uvicorn's own line
        assert '"engine_stopped"' in log  # the stages were shut down, not left behind
        await served_and_nothing_held(holder.base_url)
