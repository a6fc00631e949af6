"""`asyncpp.profiling.profiled`: off by default, a readable CPU profile when asked."""

from __future__ import annotations

import os
import pstats
import time

import pytest

from asyncpp.profiling import CLOCK_ENV_VAR, ENV_VAR, profiled


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_off_without_the_env_var(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with profiled("engine") as path:
        _spin(0.01)
    assert path is None and not list(tmp_path.iterdir())


def test_cpu_clock_charges_work_not_sleep(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "prof"))
    monkeypatch.delenv(CLOCK_ENV_VAR, raising=False)
    with profiled("engine") as path:
        _spin(0.1)
        time.sleep(0.3)
    assert path == tmp_path / "prof" / f"engine-{os.getpid()}.prof"
    stats = {func[2]: row for func, row in pstats.Stats(str(path)).stats.items()}
    spin_s, sleep_s = stats["_spin"][3], stats["<built-in method time.sleep>"][3]  # cumulative time
    assert spin_s >= 0.09 and sleep_s < 0.05


def test_unknown_clock_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    monkeypatch.setenv(CLOCK_ENV_VAR, "sundial")
    with pytest.raises(ValueError, match="ASYNCPP_PROFILE_CLOCK"), profiled("engine"):
        pass
