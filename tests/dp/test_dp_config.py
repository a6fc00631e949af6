"""A data-parallel deployment's replica configs and CPUs, and the settings it refuses."""

from __future__ import annotations

import pytest

from asyncpp.config import ConfigError, config_from_dict
from asyncpp.disagg.config import disagg_config_from_dict
from asyncpp.dp.config import check_dp, replica_cpus, replica_sections
from asyncpp.http.__main__ import max_in_flight


def sections(**overrides) -> dict:
    base = {
        "model": {"source": "hf", "path": "/models/tiny", "dtype": "float32"},
        "parallel": {"pp_size": 2, "dp_size": 3, "num_threads": 1},
        "server": {"port": 5557, "http_port": 8000, "grace_period_s": 2.0, "engine_secret": "mine"},
    }
    for name, values in overrides.items():
        base.setdefault(name, {}).update(values)
    return base


def test_a_replica_is_the_deployment_as_one_engine_on_free_ports_with_the_given_secret():
    base = sections()
    derived = replica_sections(base, 1, "deployment-secret", share_cpus=False)
    assert derived["parallel"] == {"pp_size": 2, "dp_size": 1, "num_threads": 1}  # pin_threads left as set
    assert derived["server"] == {"port": 0, "http_port": 0, "grace_period_s": 2.0, "engine_secret": "deployment-secret"}
    assert derived["model"] == base["model"]
    assert base["parallel"]["dp_size"] == 3 and base["server"]["port"] == 5557  # the deployment's own untouched
    config = config_from_dict(derived)
    assert config.parallel.dp_size == 1 and config.parallel.pin_threads is True


def test_replicas_sharing_every_cpu_pin_no_threads():
    derived = replica_sections(sections(), 0, "s", share_cpus=True)
    assert derived["parallel"]["pin_threads"] is False


def test_each_replica_writes_a_dir_store_of_its_own(tmp_path):
    kv = {"connector": "offload", "store": "dir", "store_path": str(tmp_path)}
    paths = [replica_sections(sections(kv_transfer=kv), i, "s", share_cpus=False)["kv_transfer"]["store_path"] for i in (0, 1)]
    assert paths == [str(tmp_path / "replica-0"), str(tmp_path / "replica-1")]
    shm = replica_sections(sections(kv_transfer={"connector": "offload"}), 1, "s", share_cpus=False)
    assert shm["kv_transfer"] == {"connector": "offload"}
    kept = {"connector": "offload", "store": "shm", "store_path": str(tmp_path)}  # a path the shm store ignores
    assert replica_sections(sections(kv_transfer=kept), 1, "s", share_cpus=False)["kv_transfer"] == kept


def test_a_deployment_without_parallel_and_server_tables_gets_them():
    base = {"model": {"source": "hf", "path": "/models/tiny"}}
    derived = replica_sections(base, 0, "s", share_cpus=True)
    assert derived["parallel"] == {"dp_size": 1, "pin_threads": False}
    assert derived["server"] == {"port": 0, "http_port": 0, "engine_secret": "s"}
    assert base == {"model": {"source": "hf", "path": "/models/tiny"}}


def test_a_bad_value_is_refused_naming_the_replica():
    with pytest.raises(ConfigError, match="replica 2: .*parallel.num_threads"):
        replica_sections(sections(parallel={"num_threads": 0}), 2, "s", share_cpus=False)


@pytest.mark.parametrize("cpus,dp_size,need,expected", [
    ([0, 1], 2, 1, [(0,), (1,)]),
    ([0, 1, 2, 3, 4], 2, 2, [(0, 1, 2), (3, 4)]),  # as even as possible, the first ones get the extra
    ([4, 5, 6, 7, 8, 9, 10], 3, 2, [(4, 5, 6), (7, 8), (9, 10)]),
    ([0, 1, 2], 2, 2, None),  # a replica would get fewer than its stages' threads: all share
    ([0], 2, 1, None),
])  # fmt: skip
def test_replica_cpus(cpus, dp_size, need, expected):
    assert replica_cpus(cpus, dp_size, need) == expected


def test_dp_size_must_be_positive():
    with pytest.raises(ConfigError, match="parallel.dp_size must be >= 1, got 0"):
        config_from_dict(sections(parallel={"dp_size": 0}))


def test_stages_on_ray_are_refused():
    with pytest.raises(ConfigError, match=r"^parallel.dp_size = 3 runs its replicas on this host: parallel.backend 'ray' "
                                          r"takes one engine \(dp_size = 1, and pp_size its stages\)$"):
        check_dp(config_from_dict(sections(parallel={"backend": "ray"})))


def test_a_prefill_decode_role_is_refused():
    config = config_from_dict(sections(kv_transfer={"connector": "offload", "kv_role": "producer"}))
    with pytest.raises(ConfigError) as info:
        check_dp(config)
    assert str(info.value) == (
        "parallel.dp_size = 3 cannot take kv_transfer.kv_role 'producer': the data-parallel router passes no KV "
        "handshakes (an engine of a prefill/decode pair is one engine: dp_size = 1, `asyncpp serve -dp 1`; a "
        "prefill/decode deployment is a [disagg] table)"
    )
    check_dp(config_from_dict(sections(kv_transfer={"connector": "offload"})))  # a connector alone is fine


@pytest.mark.parametrize("where", ["base", "decode"])
def test_a_prefill_decode_deployment_refuses_replicas(where):
    data = sections(parallel={"dp_size": 1})
    data["disagg"] = {"prefill": {}, "decode": {}}
    if where == "base":
        data["parallel"]["dp_size"] = 2
    else:
        data["disagg"]["decode"] = {"parallel.dp_size": 2}
    with pytest.raises(ConfigError, match="parallel.dp_size must be 1 in a prefill/decode deployment, got 2"):
        disagg_config_from_dict(data)


@pytest.mark.parametrize("dp_size,long_prompt_pp_size,expected",
                         [(1, 0, 7 + 5), (3, 0, 3 * 7 + 5), (1, 2, 7 + 5), (3, 2, 4 * 7 + 5)])  # fmt: skip
def test_the_http_front_end_takes_every_replicas_share_at_once(dp_size, long_prompt_pp_size, expected):
    parallel = {"dp_size": dp_size, "long_prompt_pp_size": long_prompt_pp_size}
    config = config_from_dict(sections(parallel=parallel, scheduler={"max_num_seqs": 7}, server={"max_queued_requests": 5}))
    assert max_in_flight(config) == expected
