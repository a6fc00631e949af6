"""Weight loaders (GGUF, HF directories, deterministic random) keyed by source."""
