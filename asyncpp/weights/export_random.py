"""`python -m asyncpp.weights.export_random NAME DIR`: a random-weights model as an HF directory.

Weights from `asyncpp.weights.random_loader` (deterministic), written with
`save_hf_directory` together with a byte-level tokenizer, so that asyncpp
(`source = "hf"`) and `transformers` load the very same model. Used where
the real GGUF cannot travel (the GPU machine): `smollm2-135m` has
SmolLM2-135M's shape.
"""

from __future__ import annotations

import argparse
import pathlib

from asyncpp.tokenizer.tokenizer import Tokenizer
from asyncpp.weights import load_weights, read_arch, save_hf_directory


def export_random(name: str, directory: str | pathlib.Path) -> pathlib.Path:
    arch = read_arch("random", name)
    tensors = load_weights("random", name, start_layer=0, end_layer=arch.num_layers, need_embed=True, need_head=True)
    path = save_hf_directory(directory, arch, tensors)
    Tokenizer.byte_level(arch.vocab_size).save_hf(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.weights.export_random", description=__doc__.split("\n")[0])
    ap.add_argument("name", help="a random config name, e.g. smollm2-135m")
    ap.add_argument("directory")
    ns = ap.parse_args(argv)
    print(export_random(ns.name, ns.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
