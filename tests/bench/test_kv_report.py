"""The benchmark's KV connector figures and its shared-prefix workload."""

from __future__ import annotations

import pytest

from asyncpp.bench.datasets import shared_prefix_requests
from asyncpp.bench.kv_report import kv_lines, kv_section


def test_kv_section_takes_window_deltas_and_rates():
    before = {"kv_connector": "offload", "kv_bytes_loaded": 1_000_000, "kv_load_time_s": 0.5, "kv_blocks_loaded": 4}
    after = {
        "kv_connector": "offload",
        "kv_bytes_loaded": 5_000_000,
        "kv_load_time_s": 0.502,
        "kv_blocks_loaded": 20,
        "num_external_prefix_hit_tokens": 256,
    }
    kv = kv_section(before, after)
    assert kv["kv_blocks_loaded"] == 16 and kv["kv_bytes_loaded"] == 4_000_000
    assert kv["load_gbps"] == pytest.approx(2.0) and kv["save_gbps"] is None
    assert kv["memcpy_gbps"] > 0
    text = "\n".join(kv_lines(kv))
    assert "from the connector 256" in text and "2.00 GB/s" in text
    assert kv_section({}, {"num_running": 0}) is None  # no connector: no section


def test_shared_prefix_requests_share_a_prefix_per_group_round_robin():
    requests = shared_prefix_requests(9, 50, 3, 10, 7, seed=1)
    words = [r.prompt.split() for r in requests]
    assert all(len(w) == 60 for w in words) and all(r.output_len == 7 for r in requests)
    assert words[0][:50] == words[3][:50] == words[6][:50] != words[1][:50]
    assert len({" ".join(w[50:]) for w in words}) == 9  # every suffix its own
    assert shared_prefix_requests(9, 50, 3, 10, 7, seed=1) == requests
    with pytest.raises(ValueError):
        shared_prefix_requests(4, 0, 2, 10, 7)
