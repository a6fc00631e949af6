"""The PD transfer benchmark runs end to end on a tiny stage in both placements: the NIXL read is
bit-exact, every rate is positive, and runs of blocks need one descriptor per tensor."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu12")

from asyncpp.bench.pd_transfer import main, measure


@pytest.mark.parametrize("placement", ["random", "runs"])
def test_measure_reports_every_path(placement):
    m = measure(num_blocks=4, block_size=2, layers=2, heads=1, head_dim=8, repeat=2, placement=placement,
                cache_blocks=16, evict_mb=0, first_touch_repeat=1)  # fmt: skip
    assert m["bit_exact"] is True
    assert m["nbytes"] == 4 * (2 * 1 * 8 * 2) * 4  # blocks x block bytes x (K, V of 2 layers)
    for key in ("nixl_gbps", "index_copy_gbps", "memcpy_gbps", "nixl_over_memcpy", "first_touch_nixl_gbps"):
        assert m[key] > 0, key
    if placement == "runs":
        assert m["num_descs"] == 4


def test_main_prints_the_ratio(capsys):
    argv = ["--num-blocks", "3", "--block-size", "2", "--layers", "1", "--heads", "1", "--head-dim", "8",
            "--repeat", "1", "--evict-mb", "0", "--first-touch-repeat", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bit-exact: True" in out and "nixl / memcpy:" in out and "first touch" in out


def test_more_blocks_than_the_cache_holds_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        measure(num_blocks=8, cache_blocks=4, repeat=1)
