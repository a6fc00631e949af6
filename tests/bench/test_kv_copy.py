"""The KV copy benchmark runs both stores end to end on a tiny stage, in both placements, checks its
round trip bit for bit, and leaves no shared-memory segment behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncpp.bench.kv_copy import main


@pytest.mark.parametrize("placement", ["random", "runs"])
def test_kv_copy_reports_every_path_and_leaves_nothing(capsys, tmp_path, placement):
    before = set(Path("/dev/shm").glob("asyncpp-bench-kv-*"))
    argv = ["--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--block-size", "4", "--num-blocks", "32",
            "--num-slots", "16", "--blocks", "5", "--repeats", "2", "--evict-mb", "0", "--dir", str(tmp_path),
            "--placement", placement]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("bit-exact: True") == 2
    assert f"({placement})" in out and "host copies:" in out
    for name in ("memcpy", "shm save", "shm load", "shm old save", "shm old load", "dir save", "dir load"):
        assert f"{name}:" in out
    assert set(Path("/dev/shm").glob("asyncpp-bench-kv-*")) == before


def test_runs_of_more_blocks_than_the_store_holds_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--blocks"):
        main(["--num-slots", "4", "--blocks", "5", "--dir", str(tmp_path)])
