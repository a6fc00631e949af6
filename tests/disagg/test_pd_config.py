"""A `[disagg]` config: the shared base, each engine's dotted-key overrides, what is refused."""

from __future__ import annotations

import pytest

from asyncpp.config import ConfigError, config_from_dict
from asyncpp.disagg.config import disagg_config_from_dict, flatten, is_disagg_config, split_cpus
from tests.runtime.harness import tiny_sections


def pd_data(prefill=None, decode=None, **disagg) -> dict:
    data = tiny_sections("/models/tiny", 2, (2, 2), kv_transfer={"connector": "pd"}, server={"port": 6000, "http_port": 8000})
    data["disagg"] = {**disagg, "prefill": prefill or {}, "decode": decode or {}}
    return data


def test_each_engine_is_the_base_with_its_overrides():
    pd = disagg_config_from_dict(pd_data({"parallel.pp_size": 1, "kv_transfer.engine_id": "p"}, {"cache": {"block_size": 32}}))
    prefill, decode = pd.engine_config("prefill"), pd.engine_config("decode")
    assert prefill.parallel.pp_size == 1 and prefill.parallel.layer_split == ()  # the base's split was for pp 2
    assert decode.parallel.pp_size == 2 and decode.parallel.layer_split == (2, 2)
    assert decode.cache.block_size == 32 and prefill.cache.block_size == 16  # TOML's own nesting reads the same
    assert (prefill.kv_transfer.kv_role, decode.kv_transfer.kv_role) == ("producer", "consumer")
    assert prefill.kv_transfer.engine_id == "p"
    for config in (prefill, decode):  # free ports, no HTTP of their own
        assert config.server.port == 0 and config.server.http_port == 0
    assert pd.shared.server.port == 6000 and pd.shared.server.http_port == 8000  # the router's
    assert (pd.section.health_interval_s, pd.section.health_timeout_s) == (0.5, 1.0)
    assert (pd.num_cpus_needed("prefill"), pd.num_cpus_needed("decode")) == (1, 2)
    assert config_from_dict(pd.engines["decode"]) == decode  # what the child reads is what was checked


def test_a_fixed_engine_port_and_router_settings_are_kept():
    pd = disagg_config_from_dict(pd_data(decode={"server.port": 7001}, health_timeout_s=2, split_cpus=False))
    assert pd.engine_config("decode").server.port == 7001
    assert pd.section.health_timeout_s == 2.0 and pd.section.split_cpus is False


@pytest.mark.parametrize("data,words", [
    (pd_data(decode={"parallel.pp_sise": 2}), "disagg.decode: unknown config key parallel.pp_sise"),
    (pd_data(prefill={"kv_transfer.kv_role": "consumer"}), "disagg.prefill: kv_transfer.kv_role must be 'producer'"),
    (pd_data(prefill={"server.http_port": 9000}), "server.http_port is the router's"),
    (pd_data(prefill={"pp_size": 2}), "must be a dotted key 'section.key'"),
    (pd_data(health_interval_s=0), "disagg.health_interval_s must be a positive number"),
    (pd_data(health_timeout=1.0), "unknown config key disagg.health_timeout"),
    (pd_data(prefill={"model.dtype": 3}), "disagg.prefill: config key model.dtype must be str"),
])  # fmt: skip
def test_bad_keys_are_refused_naming_them(data, words):
    with pytest.raises(ConfigError, match=words):
        disagg_config_from_dict(data)


def test_the_base_must_be_a_valid_config_itself():
    data = pd_data()
    data["cache"]["block_sise"] = 16
    with pytest.raises(ConfigError, match="unknown config key cache.block_sise"):
        disagg_config_from_dict(data)


def test_only_a_config_with_a_disagg_table_is_one(tmp_path):
    (tmp_path / "pd.toml").write_text('[model]\nsource = "random"\n[disagg]\n[disagg.prefill]\n"parallel.pp_size" = 1\n')
    (tmp_path / "one.toml").write_text('[model]\nsource = "random"\n')
    (tmp_path / "bad.toml").write_text("[model\n")
    assert is_disagg_config(tmp_path / "pd.toml")
    assert not is_disagg_config(tmp_path / "one.toml") and not is_disagg_config(tmp_path / "bad.toml")
    assert not is_disagg_config(tmp_path / "missing.toml")


def test_flatten_reads_quoted_and_nested_keys_alike():
    assert flatten({"parallel.pp_size": 2, "cache": {"block_size": 8}, "kv_transfer.options": {"a": 1}}) == [
        ("parallel.pp_size", 2), ("cache.block_size", 8), ("kv_transfer.options", {"a": 1})
    ]  # fmt: skip


def test_cpus_are_split_when_there_are_enough():
    assert split_cpus([0, 1], [1, 1]) == [(0,), (1,)]
    assert split_cpus([0, 1, 2, 3, 4], [2, 1]) == [(0, 1), (2, 3, 4)]  # the rest to the decode engine
    assert split_cpus([0, 1], [2, 1]) is None


def test_the_shipped_pd_configs_load():
    from asyncpp.disagg.config import load_disagg_config

    for name in ("pd-1-1", "pd-2-1"):
        pd = load_disagg_config(f"configs/{name}.toml")
        assert pd.engine_config("prefill").kv_transfer.connector == "pd"
        assert pd.engine_config("prefill").parallel.pp_size == int(name[3])
