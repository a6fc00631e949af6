"""A synchronous offload load that hangs past `load_timeout_s` (in-process, tiny model): its blocks
count as failed and are recomputed, token-exact, and nothing is left held. The asynchronous case is
in `test_transfer_faults.py`; this one goes through the worker's own wait (`_wait_load`), which no
other test reached (found by mutation testing)."""

from __future__ import annotations

import pytest

from tests.kv_transfer.test_transfer_faults import (  # noqa: F401
    FIRST,
    LATER,
    assert_settled,
    engine,
    expected,
    flush,
    run,
)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_sync_load_that_hangs_times_out_and_is_recomputed(tiny_hf_dir, expected, pp_size):  # noqa: F811
    options = {"load": "sync", "load_fault": "hang", "hang_s": 1.5, "fault_pp_rank": pp_size - 1}
    e = engine(tiny_hf_dir, pp_size, options=options, load_timeout_s=0.2)
    run(e, FIRST)
    flush(e)
    assert run(e, LATER).token_ids == expected["later"]
    stats = e.scheduler.stats()
    assert stats.num_external_prefix_hit_tokens == 0 and stats.num_failed_load_tokens > 0
    assert_settled(e)
    e.close()
