"""Config: TOML into a frozen tree; unknown keys and wrong types are named."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from asyncpp.config import AUTO_SHIFT_LAYERS, ConfigError, EngineConfig, config_from_dict, load_config
from asyncpp.disagg.config import is_disagg_config, load_disagg_config
from tests.conftest import default_pipeline_sections

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIGS / "default.toml"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_shipped_configs_load(name):
    if is_disagg_config(CONFIGS / name):  # a prefill/decode deployment: its shared tables and both engines'
        pd = load_disagg_config(CONFIGS / name)
        assert all(isinstance(pd.engine_config(role), EngineConfig) for role in ("prefill", "decode"))
        return
    config = load_config(CONFIGS / name)
    assert isinstance(config, EngineConfig)


def test_default_config_is_the_documented_deployment():
    config = load_config(CONFIGS / "default.toml")
    assert (config.model.source, config.model.dtype, config.model.device) == ("gguf", "auto", "cpu")
    assert (config.model.cpu_isa, config.model.weight_format) == ("auto", "auto")
    assert (config.parallel.dp_size, config.parallel.pp_size, config.parallel.num_threads) == (2, 1, 1)
    assert (config.parallel.long_prompt_pp_size, config.parallel.long_prompt_tokens) == (2, 512)
    pipeline = config_from_dict(default_pipeline_sections())  # the long prompts' engine
    assert (pipeline.parallel.dp_size, pipeline.parallel.pp_size, pipeline.steps_in_flight) == (1, 2, 2)
    assert pipeline.shift_layers == AUTO_SHIFT_LAYERS and pipeline.server.port == 0
    assert config.server.host == "127.0.0.1"
    assert config.parallel.step_timeout_s == 60.0  # generous: a long prompt chunk on a slow CPU


def test_config_is_frozen():
    config = config_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.dtype = "float32"  # type: ignore[misc]


@pytest.mark.parametrize(
    "data,words",
    [
        ({"modle": {}}, "unknown config key modle"),
        ({"cache": {"block_sise": 16}}, "unknown config key cache.block_sise"),
        ({"cache": {"block_size": "16"}}, "cache.block_size must be int, got str"),
        ({"cache": {"block_size": True}}, "cache.block_size must be int, got bool"),
        ({"cache": {"block_size": 0}}, "cache.block_size must be >= 1"),
        ({"model": {"dtype": "float8"}}, "model.dtype"),
        ({"model": {"source": "onnx"}}, "model.source"),
        ({"model": {"linear_kernel": "mkl"}}, "model.linear_kernel must be one of"),
        ({"model": {"cpu_isa": "sse4"}}, "model.cpu_isa must be one of"),
        ({"model": {"cpu_isa": "AVX2"}}, "model.cpu_isa must be one of"),
        ({"model": {"weight_format": "q4_0"}}, "model.weight_format must be one of"),
        ({"model": {"dtype": "int8"}}, "model.dtype must be one of"),
        ({"model": "gguf"}, "section model must be a table"),
        ({"parallel": {"pp_size": 2, "layer_split": [1, "2"]}}, "parallel.layer_split[1] must be int"),
        ({"parallel": {"pp_size": 3, "layer_split": [1, 2]}}, "parallel.layer_split has 2 entries"),
        ({"server": {"grace_period_s": "soon"}}, "server.grace_period_s must be float"),
        ({"server": {"max_queued_requests": -1}}, "server.max_queued_requests must be >= 0"),
        ({"server": {"max_frame_bytes": 0}}, "server.max_frame_bytes must be >= 1"),
        ({"server": {"metrics_require_key": "yes"}}, "server.metrics_require_key must be bool"),
        ({"parallel": {"pp_size": 2, "max_steps_in_flight": 4}},
         "parallel.max_steps_in_flight must be 0 (= pp_size) or 1..pp_size + 1 = 3, got 4"),
        ({"parallel": {"pp_size": 0}}, "parallel.pp_size must be >= 1, got 0"),
        ({"parallel": {"num_threads": 0}}, "parallel.num_threads must be >= 1, got 0"),
        ({"parallel": {"max_stage_restarts": -1}}, "parallel.max_stage_restarts must be >= 0, got -1"),
        ({"parallel": {"pp_size": 2, "layer_split": [3, 0]}}, "parallel.layer_split entries must be >= 1, got 0"),
        ({"cache": {"num_kv_blocks_override": -1}}, "cache.num_kv_blocks_override must be >= 0, got -1"),
        ({"parallel": {"max_steps_in_flight": -1}}, "parallel.max_steps_in_flight must be"),
        ({"parallel": {"stage_nice": 20}}, "parallel.stage_nice must be in 0..19"),
        ({"parallel": {"stage_nice": -1}}, "parallel.stage_nice must be in 0..19"),
        ({"parallel": {"shift_layers": -2}}, "parallel.shift_layers must be >= 0 (or -1, auto)"),
        ({"parallel": {"step_timeout_s": 0}}, "parallel.step_timeout_s must be a positive number of seconds"),
        ({"parallel": {"step_timeout_s": -1.5}}, "parallel.step_timeout_s must be a positive number of seconds"),
        ({"parallel": {"step_timeout_s": float("inf")}}, "parallel.step_timeout_s must be a positive number"),
        ({"parallel": {"step_timeout_s": "30"}}, "parallel.step_timeout_s must be float"),
        ({"scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 16}}, "max_num_batched_tokens"),
    ],
)
def test_bad_config_names_the_key(data, words):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert words in str(info.value)


@pytest.mark.parametrize("parallel,stages", [
    ({"dp_size": 1, "pp_size": 2, "long_prompt_pp_size": 2}, (2,)),  # no long-prompt engine beside one engine
    ({"dp_size": 2, "pp_size": 1, "long_prompt_pp_size": 2}, (1, 1, 2)),  # the default's
    ({"dp_size": 3, "pp_size": 2, "long_prompt_pp_size": 0}, (2, 2, 2)),
    ({"dp_size": 2, "pp_size": 1, "long_prompt_pp_size": 3}, (1, 1, 3)),
])  # fmt: skip
def test_engine_stages_lists_every_engine_the_launcher_starts(parallel, stages):
    assert config_from_dict({"parallel": parallel}).parallel.engine_stages == stages


def test_the_lowest_values_allowed_are_accepted():
    parallel = config_from_dict({"parallel": {"max_stage_restarts": 0, "long_prompt_pp_size": 0,
                                              "long_prompt_tokens": 1}}).parallel  # fmt: skip
    assert (parallel.max_stage_restarts, parallel.long_prompt_pp_size, parallel.long_prompt_tokens) == (0, 0, 1)
    assert config_from_dict({"cache": {"num_kv_blocks_override": 0}, "server": {"max_queued_requests": 0}})


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nsource = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_model_defaults_leave_dtype_and_isa_to_start_up():
    model = config_from_dict({}).model
    assert (model.dtype, model.cpu_isa, model.weight_format) == ("auto", "auto", "auto")
    # Every level is accepted here, whether or not this CPU runs it: that is checked at start-up.
    for level in ("generic", "avx2", "avx512", "avx512_bf16", "amx"):
        assert config_from_dict({"model": {"cpu_isa": level}}).model.cpu_isa == level
    assert config_from_dict({"model": {"weight_format": "native", "dtype": "float32"}}).model.weight_format == "native"


def test_int_accepted_for_float_fields():
    assert config_from_dict({"server": {"grace_period_s": 3}}).server.grace_period_s == 3.0


def test_shift_layers_apply_to_cpu_pipelines_without_a_connector():
    cpu = config_from_dict({"parallel": {"pp_size": 2, "shift_layers": 3}})
    assert cpu.shift_layers == 3 and cpu.shift_layers_off_reason is None
    assert config_from_dict({"parallel": {"shift_layers": 3}}).shift_layers == 0  # pp_size 1: nothing to shift
    offload = config_from_dict({"parallel": {"pp_size": 2, "shift_layers": 3}, "kv_transfer": {"connector": "offload"}})
    assert offload.shift_layers == 0 and "KV connector" in offload.shift_layers_off_reason
    gpu = config_from_dict({"model": {"device": "cuda"}, "parallel": {"pp_size": 2, "shift_layers": 3}})
    assert gpu.shift_layers == 0 and "GPU" in gpu.shift_layers_off_reason


def test_auto_shift_layers_takes_what_the_deployment_allows_and_a_value_set_is_refused_under_ray():
    auto = {"pp_size": 2, "shift_layers": -1}
    local = config_from_dict({"parallel": auto})
    assert local.shift_layers == AUTO_SHIFT_LAYERS == 4 and local.shift_layers_off_reason is None
    assert config_from_dict({"parallel": {"shift_layers": -1}}).shift_layers == 0  # one stage
    ray = config_from_dict({"parallel": {**auto, "backend": "ray"}})
    assert ray.shift_layers == 0 and "Ray" in ray.shift_layers_off_reason
    offload = config_from_dict({"parallel": auto, "kv_transfer": {"connector": "offload"}})
    assert offload.shift_layers == 0 and "KV connector" in offload.shift_layers_off_reason
    gpu = config_from_dict({"model": {"device": "cuda"}, "parallel": auto})
    assert gpu.shift_layers == 0 and "GPU" in gpu.shift_layers_off_reason
    with pytest.raises(ConfigError, match=r"parallel.shift_layers must be 0 \(or -1, auto\) with parallel.backend = 'ray'"):
        config_from_dict({"parallel": {"pp_size": 2, "shift_layers": 4, "backend": "ray"}})


def test_the_default_pipeline_with_only_the_ray_backend_set_is_a_valid_config():
    sections = default_pipeline_sections()
    sections["parallel"]["backend"] = "ray"
    config = config_from_dict(sections)
    assert config.parallel.shift_layers == -1 and config.shift_layers == 0
    assert config_from_dict(default_pipeline_sections()).shift_layers == AUTO_SHIFT_LAYERS


def test_what_shift_layers_comes_to_is_logged_once_at_start_up():
    from asyncpp.engine.startup import log_shift_layers

    class Recorder:
        def __init__(self) -> None:
            self.events = []

        def info(self, event, **fields):
            self.events.append(("info", event, fields))

        def warning(self, event, **fields):
            self.events.append(("warning", event, fields))

    def logged(data: dict) -> list:
        log = Recorder()
        log_shift_layers(config_from_dict(data), log)
        return log.events

    auto = {"pp_size": 2, "shift_layers": -1}
    assert logged({"parallel": auto}) == [("info", "shift_layers_auto", {"shift_layers": 4, "reason": "CPU stages run locally"})]
    [(level, event, fields)] = logged({"parallel": {**auto, "backend": "ray"}})
    assert (level, event, fields["shift_layers"]) == ("info", "shift_layers_auto", 0) and "Ray" in fields["reason"]
    [(level, event, fields)] = logged({"parallel": {"pp_size": 2, "shift_layers": 3}, "kv_transfer": {"connector": "offload"}})
    assert (level, event, fields["shift_layers"]) == ("warning", "shift_layers_off", 3) and "KV connector" in fields["reason"]
    assert logged({"parallel": {"pp_size": 2, "shift_layers": 3}}) == []  # set, and it applies
    assert logged({"parallel": {"shift_layers": -1}}) == []  # one stage: nothing to shift


@pytest.mark.parametrize(
    "parallel,model_device,expected",
    [
        ({"pp_size": 2}, "cuda", 1),  # both stages on cuda:0: their steps take turns on it
        ({"pp_size": 2, "devices": ["cuda:0", "cuda"]}, "cuda", 1),
        ({"pp_size": 2, "devices": ["cuda:0", "cuda:1"]}, "cuda", 2),
        ({"pp_size": 3}, "cpu", 3),
        ({"pp_size": 1}, "cuda", 1),
        ({"pp_size": 2, "max_steps_in_flight": 3}, "cuda", 3),
    ],
)
def test_cohorts_in_flight_one_per_stage_unless_the_stages_share_a_gpu(parallel, model_device, expected):
    config = config_from_dict({"model": {"device": model_device}, "parallel": parallel})
    assert config.steps_in_flight == expected


@pytest.mark.parametrize(
    "sections,expected",
    [
        ({"model": {"device": "cuda"}, "parallel": {"pp_size": 2}}, True),  # auto: between local CUDA stages
        ({"parallel": {"pp_size": 2}}, False),  # CPU: tokens in messages
        ({"parallel": {"pp_size": 2, "token_handoff": "ring"}}, True),  # CPU stages on request (tests)
        ({"model": {"device": "cuda"}, "parallel": {"pp_size": 2, "token_handoff": "host"}}, False),
        ({"model": {"device": "cuda"}, "parallel": {"pp_size": 1}}, False),
        ({"model": {"device": "cuda"}, "parallel": {"pp_size": 2}, "scheduler": {"async_scheduling": False}}, False),
        ({"model": {"device": "cuda"}, "parallel": {"pp_size": 2, "backend": "ray"}}, False),
    ],
)
def test_token_ring_where_it_applies(sections, expected):
    assert config_from_dict(sections).uses_token_ring == expected


@pytest.mark.parametrize(
    "sections,reason",
    [
        ({"parallel": {"pp_size": 1, "token_handoff": "ring"}}, "pp_size > 1"),
        ({"parallel": {"pp_size": 2, "token_handoff": "ring"}, "scheduler": {"async_scheduling": False}}, "async_scheduling"),
        ({"parallel": {"pp_size": 2, "token_handoff": "ring", "backend": "ray"}}, "backend = 'local'"),
        ({"parallel": {"token_handoff": "gpu"}}, "must be one of"),
    ],
)
def test_a_token_ring_that_cannot_apply_is_refused_naming_why(sections, reason):
    with pytest.raises(ConfigError, match=f"parallel.token_handoff.*{re.escape(reason)}"):
        config_from_dict(sections)
