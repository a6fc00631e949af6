"""The KV copy benchmark runs both stores end to end on a tiny stage, checks its round trip bit for bit,
and leaves no shared-memory segment behind."""

from __future__ import annotations

from pathlib import Path

from asyncpp.bench.kv_copy import main


def test_kv_copy_reports_every_path_and_leaves_nothing(capsys, tmp_path):
    before = set(Path("/dev/shm").glob("asyncpp-bench-kv-*"))
    argv = ["--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--block-size", "4", "--num-blocks", "32",
            "--num-slots", "16", "--blocks", "5", "--repeats", "2", "--evict-mb", "0", "--dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("bit-exact: True") == 2
    for name in ("memcpy", "shm save", "shm load", "shm old save", "shm old load", "dir save", "dir load"):
        assert f"{name}:" in out
    assert set(Path("/dev/shm").glob("asyncpp-bench-kv-*")) == before
