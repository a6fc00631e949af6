"""Weight loaders (GGUF, HF directories, deterministic random) keyed by source.

Entry points: `read_arch` and `load_weights` (see `registry.py` for the
contract), `save_hf_directory` to export a model as an HF directory, and
`default_gguf_path` for the bundled SmolLM2-135M GGUF.
"""

from asyncpp.weights.gguf_loader import default_gguf_path
from asyncpp.weights.hf_export import save_hf_directory
from asyncpp.weights.registry import known_sources, load_weights, read_arch, register_loader

__all__ = [
    "default_gguf_path",
    "known_sources",
    "load_weights",
    "read_arch",
    "register_loader",
    "save_hf_directory",
]
