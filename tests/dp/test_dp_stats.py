"""The replicas' stats merged into one engine's."""

from __future__ import annotations

from asyncpp.dp.stats import RouterCounters, is_summed, merged_stats


def test_counts_are_summed_and_descriptions_are_the_first_answering_replicas():
    a = {"num_running": 2, "num_kv_blocks": 10, "kv_num_handovers": 1, "kv_blocks_loaded": 5, "kv_bytes_saved": 100,
         "stage_restarts": 1, "cpu_s": 1.5, "dtype": "bfloat16", "kv_usage": 0.25, "num_spare_cpus": None,
         "handoff_us_p50": [10.0], "kv_handover_s_p50": 0.5}  # fmt: skip
    b = {"num_running": 3, "num_kv_blocks": 10, "kv_num_handovers": 2, "kv_blocks_loaded": 1, "kv_bytes_saved": 7,
         "stage_restarts": 0, "cpu_s": 0.5, "dtype": "float32", "kv_usage": 0.75, "num_spare_cpus": None,
         "handoff_us_p50": [20.0], "kv_handover_s_p50": 0.9}  # fmt: skip
    merged = merged_stats([None, a, b], {"dp_size": 3})
    assert merged == {
        "num_running": 5, "num_kv_blocks": 20, "kv_num_handovers": 3, "kv_blocks_loaded": 6, "kv_bytes_saved": 107,
        "stage_restarts": 1, "cpu_s": 2.0, "dtype": "bfloat16", "kv_usage": 0.25, "num_spare_cpus": None,
        "handoff_us_p50": [10.0], "kv_handover_s_p50": 0.5, "replicas": [None, a, b], "dp_size": 3,
    }  # fmt: skip
    assert a["handoff_us_p50"] == [10.0]  # the replica's own list is not the merged one


def test_per_process_values_stay_with_their_replica():
    a = {"pid": 1, "stage_pids": [2, 3], "run_id": "x", "uptime_s": 5.0, "layer_balance": {"bounds": [15]},
         "is_dead": False, "num_steps": 4}  # fmt: skip
    b = {**a, "pid": 9, "stage_pids": [10], "run_id": "y", "num_steps": 6}
    assert merged_stats([a, b], {"run_id": "router"}) == {
        "num_steps": 10, "stage_pids": [2, 3, 10], "replicas": [a, b], "run_id": "router",
    }  # every stage process of the deployment: what a benchmark's CPU accounting reads


def test_recovery_times_are_joined_and_draft_acceptance_added_by_position():
    a = {"stage_recovery_s": [1.0], "spec_decode_num_accepted_tokens_per_pos": [5, 3]}
    b = {"stage_recovery_s": [2.0, 3.0], "spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}
    c = {"stage_recovery_s": [], "spec_decode_num_accepted_tokens_per_pos": [1]}
    merged = merged_stats([a, b, c], {})
    assert merged["stage_recovery_s"] == [1.0, 2.0, 3.0]
    assert merged["spec_decode_num_accepted_tokens_per_pos"] == [10, 5, 1]
    assert a["stage_recovery_s"] == [1.0] and a["spec_decode_num_accepted_tokens_per_pos"] == [5, 3]


def test_a_value_summed_only_where_both_are_numbers():
    assert merged_stats([{"num_x": None}, {"num_x": 3}], {})["num_x"] is None
    assert merged_stats([{"num_x": 3}, {"num_x": None}], {})["num_x"] == 3
    assert merged_stats([{"num_x": True}, {"num_x": True}], {})["num_x"] is True


def test_which_keys_are_counts():
    assert is_summed("num_running", 1) and is_summed("kv_num_handovers", 2) and is_summed("cpu_s", 0.5)
    assert is_summed("stage_restarts", 0) and is_summed("kv_bytes_loaded", 10)
    assert not is_summed("num_running", True) and not is_summed("num_running", None)
    assert not is_summed("num_running", "3") and not is_summed("uptime", 3) and not is_summed("kv_usage", 0.5)
    assert not is_summed("renum_x", 1)


def test_no_replica_answering_leaves_the_router_alone():
    assert merged_stats([None, None], {"dp_size": 2}) == {"replicas": [None, None], "dp_size": 2}


def test_router_counters():
    counters = RouterCounters(num_requests=4, num_finished=2, num_aborted=1, num_failed=1)
    assert counters.stats() == {"dp_num_requests": 4, "dp_num_finished": 2, "dp_num_aborted": 1, "dp_num_failed": 1}
