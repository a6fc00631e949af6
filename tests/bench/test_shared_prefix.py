"""The shared-prefix workload: prompts, prefix groups per burst, cold/warm TTFT, its flags."""

from __future__ import annotations

import pytest

from asyncpp.bench import serve
from asyncpp.bench.datasets import random_requests
from asyncpp.bench.metrics import RequestRecord
from asyncpp.bench.shared_prefix import cold_warm_ttft, prefix_group, shared_prefix_requests

PREFIX_LEN = 50
SUFFIX_LEN = 10


def split(prompt: str) -> tuple[str, str]:
    words = prompt.split()
    return " ".join(words[:PREFIX_LEN]), " ".join(words[PREFIX_LEN:])


def test_prefix_shared_within_a_group_distinct_across_groups_suffixes_own():
    requests = shared_prefix_requests(12, PREFIX_LEN, 3, SUFFIX_LEN, 7, burst_size=2, seed=1)
    assert all(len(r.prompt.split()) == PREFIX_LEN + SUFFIX_LEN and r.output_len == 7 for r in requests)
    prefixes, suffixes = zip(*(split(r.prompt) for r in requests))
    # Bursts of 2 on 3 groups: requests 0-1 group 0, 2-3 group 1, 4-5 group 2, 6-7 group 0 again...
    assert [prefix_group(i, 3, 2) for i in range(12)] == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
    for i, prefix in enumerate(prefixes):
        assert prefix == prefixes[2 * prefix_group(i, 3, 2)]
    assert len(set(prefixes)) == 3
    assert len(set(suffixes)) == 12


def test_without_bursts_groups_go_round_robin():
    requests = shared_prefix_requests(6, PREFIX_LEN, 3, SUFFIX_LEN, 7)
    prefixes = [split(r.prompt)[0] for r in requests]
    assert prefixes[:3] == prefixes[3:] and len(set(prefixes)) == 3


def test_seeded_and_suffix_is_the_random_workload():
    requests = shared_prefix_requests(8, PREFIX_LEN, 2, SUFFIX_LEN, 7, burst_size=4, range_ratio=0.5, seed=3)
    assert requests == shared_prefix_requests(8, PREFIX_LEN, 2, SUFFIX_LEN, 7, burst_size=4, range_ratio=0.5, seed=3)
    assert requests != shared_prefix_requests(8, PREFIX_LEN, 2, SUFFIX_LEN, 7, burst_size=4, range_ratio=0.5, seed=4)
    plain = random_requests(8, SUFFIX_LEN, 7, 0.5, 3)
    assert [split(r.prompt)[1] for r in requests] == [r.prompt for r in plain]
    assert [r.output_len for r in requests] == [r.output_len for r in plain]
    with pytest.raises(ValueError):
        shared_prefix_requests(4, 0, 2, SUFFIX_LEN, 7)


def test_warmup_shares_no_prefix_and_is_as_long_as_the_prompts():
    args = serve.parse_args(["--num-prompts", "8", "--shared-prefix-len", "40", "--shared-prefix-groups", "2",
                             "--random-input-len", "8", "--burst-size", "4"])
    requests, warmup = serve.make_requests(args)
    prefixes = {" ".join(r.prompt.split()[:40]) for r in requests}
    assert len(prefixes) == 2
    for r in warmup:
        assert len(r.prompt.split()) == 48
        assert not any(r.prompt.split()[:4] == p.split()[:4] for p in prefixes)


@pytest.mark.parametrize("argv", [
    ["--shared-prefix-len", "-1"],
    ["--shared-prefix-len", "8", "--shared-prefix-groups", "0"],
    ["--shared-prefix-len", "8", "--dataset", "x.jsonl"],
    ["--burst-size", "0"],
    ["--burst-size", "4", "--burst-gap-s", "-1"],
    ["--burst-size", "4", "--request-rate", "10"],
])
def test_bad_flag_combinations_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(argv)


def test_defaults_leave_the_workload_off():
    args = serve.parse_args([])
    assert (args.shared_prefix_len, args.shared_prefix_groups, args.burst_size, args.burst_gap_s) == (0, 1, None, 0.5)


def ok(ttft_s: float, burst: int | None) -> RequestRecord:
    return RequestRecord(ttft_s=ttft_s, e2e_s=ttft_s + 1.0, burst=burst)


def test_cold_is_the_first_burst_of_each_group_warm_the_later_ones():
    # Bursts of 2 on 2 groups: bursts 0 and 1 meet their prefix first, bursts 2 and 3 come back to it.
    records = [ok(0.5, 0), ok(0.7, 0), ok(0.6, 1), ok(0.8, 1), ok(0.1, 2), ok(0.2, 2), ok(0.1, 3)]
    records.append(RequestRecord(ttft_s=0.05, burst=3, error="boom"))  # failed: in no split
    split_ms = cold_warm_ttft(records, [prefix_group(i, 2, 2) for i in range(8)])
    cold, warm = split_ms["ttft_cold_ms"], split_ms["ttft_warm_ms"]
    assert cold["count"] == 4 and cold["p50"] == pytest.approx(650.0) and cold["p99"] == pytest.approx(797.0)
    assert warm["count"] == 3 and warm["p50"] == pytest.approx(100.0)


def test_without_bursts_the_first_request_of_each_group_is_cold():
    records = [ok(0.5, None), ok(0.6, None), ok(0.1, None), ok(0.2, None)]
    split_ms = cold_warm_ttft(records, [prefix_group(i, 2, None) for i in range(4)])
    assert split_ms["ttft_cold_ms"]["count"] == 2 and split_ms["ttft_warm_ms"]["p50"] == pytest.approx(150.0)
    empty = cold_warm_ttft([], [])
    assert empty["ttft_warm_ms"] == {"p50": None, "p99": None, "count": 0}
