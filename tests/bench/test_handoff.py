"""The hand-off benchmark runs a real receiver process and leaves nothing behind (CPU: the shm ring)."""

from __future__ import annotations

from pathlib import Path

from asyncpp.bench.handoff import main, measure


def test_handoff_rows_and_no_leftover_segments(capsys):
    before = set(Path("/dev/shm").glob("asyncpp-handoff-*"))
    rows = measure("cpu", [1, 32], hidden_size=64, dtype="float32", iters=5)
    assert [r["num_tokens"] for r in rows] == [1, 32]
    assert rows[1]["bytes"] == 2 * 32 * 64 * 4
    assert all(r["handoff_us"] > 0 and r["copy_us"] > 0 for r in rows)
    assert set(Path("/dev/shm").glob("asyncpp-handoff-*")) == before
    assert main(["--tokens", "4", "--hidden-size", "32", "--iters", "3"]) == 0
    assert "hand-off us" in capsys.readouterr().out
