"""A stage restart with the offload connector: requeued requests load their KV back from the stores.

A pp = 3 engine with shared-memory offload stores serves 16 requests (greedy and
seeded, n-gram drafts on) undisturbed; their blocks are then sealed in every
stage's store (and still in the engine's own cache, large enough for all).
Served again, its middle stage is killed once some requests decode: the new
stages adopt the stores the killed ones left, the engine's cache is emptied,
and the requeued requests load their prefixes from the stores instead of
computing them (the counters of loaded tokens rise only then). Every request
ends with the tokens of the undisturbed run; no store is left behind.
"""

from __future__ import annotations

import json
import os
import signal

from asyncpp.client import AsyncClient
from tests.runtime.conftest import poll_until
from tests.runtime.harness import launched, shm_segments, tiny_sections
from tests.kv_transfer.test_offload_runtime import settled
from tests.runtime.test_stage_restart import LIVENESS_S, _events, _requests, _serve_all


async def test_killed_stage_requests_reload_from_the_offload_stores_exactly(tmp_path, tiny_hf_dir):
    sections = tiny_sections(
        tiny_hf_dir, 3, (1, 1, 2),
        parallel={"max_stage_restarts": 3},
        cache={"num_kv_blocks_override": 200},
        scheduler={"max_num_batched_tokens": 48},
        speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
        kv_transfer={"connector": "offload", "store_size_mb": 4},
    )  # fmt: skip
    vocab_size = json.loads((tiny_hf_dir / "config.json").read_text())["vocab_size"]
    requests = _requests(vocab_size)
    with launched(tmp_path, sections) as engine:
        client = AsyncClient(engine.address)
        try:
            expected = await _serve_all(client, requests)
            before = await poll_until(client.stats, settled, LIVENESS_S)
            assert before["kv_store_ready_blocks"] > 0 and before["num_external_prefix_hit_tokens"] == 0
            run_id, pids = before["run_id"], before["stage_pids"]
            segments = shm_segments(f"asyncpp-{run_id}")

            async def kill() -> None:
                os.kill(pids[1], signal.SIGKILL)

            assert await _serve_all(client, requests, kill) == expected
            after = await poll_until(client.stats, settled, LIVENESS_S)
            assert after["stage_restarts"] == 1 and after["num_recomputed_requests"] > 0
            assert shm_segments(f"asyncpp-{run_id}") == segments  # the stores were adopted, not made anew
        finally:
            client.close()
    assert engine.proc.returncode == 0, "".join(engine.output[-40:])
    assert after["num_external_prefix_hit_tokens"] > 0  # the reload path: loaded, not computed
    assert after["kv_blocks_loaded"] > before["kv_blocks_loaded"] and after["kv_bytes_loaded"] > 0
    assert after["kv_store_pinned_blocks"] == after["kv_store_pending_blocks"] == 0
    assert after["num_free_kv_blocks"] == after["num_kv_blocks"]
    events = _events(engine.log_file)
    assert sum(e.get("event") == "kv_store_transfers_forgotten" for e in events) == 1
    assert sum(e.get("event") == "stage_recovered" for e in events) == 1
    assert shm_segments(f"asyncpp-{run_id}") == []
