"""Fixtures for the trace tests: one synthetic pp=3 log with bad lines, on disk and parsed."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncpp.trace import ParsedLog, parse_log
from tests.trace.log_gen import SimLog, simulate, with_bad_lines


@pytest.fixture(scope="module")
def sim() -> SimLog:
    return with_bad_lines(simulate(pp_size=3, num_steps=24, max_in_flight=3))


@pytest.fixture(scope="module")
def log_path(sim: SimLog, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "run.log"
    path.write_text(sim.text())
    return path


@pytest.fixture(scope="module")
def parsed(log_path: Path) -> ParsedLog:
    return parse_log(log_path)
