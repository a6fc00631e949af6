"""`kill=RANK@SECONDS` runs of the serving benchmark: parsing, and the recovery section's figures."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from asyncpp.bench.metrics import RequestRecord
from asyncpp.bench.runs import parse_runs
from asyncpp.bench.stage_kill import StageKill, kill_stage, recovery_section, token_times


def test_a_run_names_the_stage_and_when():
    plain, killed = parse_runs("pp=2;pp=2,kill=1@20")
    assert plain.stage_kill() is None
    assert killed.stage_kill() == StageKill(1, 20.0)
    assert StageKill.parse("0@0.5") == StageKill(0, 0.5)


@pytest.mark.parametrize("text", ["1", "a@2", "1@x", "-1@2", "1@-2", "@3", ""])
def test_a_bad_kill_is_refused(text):
    with pytest.raises(ValueError, match="RANK@SECONDS"):
        StageKill.parse(text)


def test_token_times_add_up_the_gaps():
    record = RequestRecord(sent_at=10.0, ttft_s=0.5, itl_s=[0.25, 1.0])
    assert token_times(record) == [10.5, 10.75, 11.75]
    assert token_times(RequestRecord(sent_at=3.0)) == []


def test_the_recovery_section_reads_the_first_token_after_the_kill_and_the_stats_deltas():
    records = [
        RequestRecord(sent_at=0.0, ttft_s=1.0, itl_s=[1.0, 5.0], e2e_s=7.0),  # tokens at 1, 2, 7
        RequestRecord(sent_at=1.0, ttft_s=5.5, e2e_s=5.5),  # a token at 6.5
        RequestRecord(sent_at=1.0, error="boom"),
    ]
    before = {"stage_restarts": 1, "num_recomputed_requests": 2, "num_recomputed_tokens": 100}
    after = {
        "stage_restarts": 2, "num_recomputed_requests": 5, "num_recomputed_tokens": 400,
        "stage_start_s": [3.0, 2.5], "stage_recovery_s": [2.9],
    }  # fmt: skip
    section = recovery_section(records, 2.5, before, after)
    assert section == {
        "kill_to_next_token_s": 4.0,
        "stage_start_s": [3.0, 2.5],
        "stage_recovery_s": [2.9],
        "num_restarts": 1,
        "num_recomputed_requests": 3,
        "num_recomputed_tokens": 300,
        "num_failed_requests": 1,
    }
    assert recovery_section(records, 100.0, before, after)["kill_to_next_token_s"] is None


def test_a_token_at_the_kill_itself_is_not_after_it_and_missing_stats_count_zero():
    records = [RequestRecord(sent_at=0.0, ttft_s=2.0, itl_s=[1.5], e2e_s=3.5)]  # tokens at 2.0, 3.5
    section = recovery_section(records, 2.0, {}, {})
    assert section["kill_to_next_token_s"] == 1.5
    assert section["stage_start_s"] == [] and section["stage_recovery_s"] == []
    assert section["num_restarts"] == section["num_recomputed_requests"] == section["num_recomputed_tokens"] == 0
    assert recovery_section(records, 2.0, {"stage_restarts": 2}, {"stage_restarts": 2})["num_restarts"] == 0


async def test_kill_stage_sigkills_the_named_stage_after_the_delay():
    victims = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:

        async def stats():
            return {"stage_pids": [p.pid for p in victims]}

        started = time.monotonic()
        killed_at = await kill_stage(StageKill(1, 0.2), stats)
        assert killed_at - started >= 0.2
        assert victims[1].wait(timeout=10) == -9  # SIGKILL
        assert victims[0].poll() is None
    finally:
        for p in victims:
            p.kill()
            p.wait()
    assert StageKill.parse("1@0") == StageKill(1, 0.0)
