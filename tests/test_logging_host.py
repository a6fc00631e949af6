"""JSON log lines name the host they were written on (stages may run on other hosts)."""

from __future__ import annotations

import json
import socket

from asyncpp.logging import configure_logging, get_logger


def test_json_lines_carry_the_host_name(tmp_path):
    path = tmp_path / "log.jsonl"
    try:
        configure_logging("json", "info", str(path))
        get_logger(role="test").info("hello", x=1)
    finally:
        configure_logging(level="warning")
    line = json.loads(path.read_text().strip().splitlines()[-1])
    assert line["event"] == "hello" and line["host"] == socket.gethostname() and line["role"] == "test"
