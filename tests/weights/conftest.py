"""Fixtures for weight-loader tests (helpers live in `weights_helpers.py`)."""

from __future__ import annotations

import pytest
import torch

from asyncpp.weights import read_arch, save_hf_directory
from asyncpp.weights.random_loader import RANDOM_CONFIGS
from weights_helpers import load_all

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def saved_random_model(tmp_path_factory: pytest.TempPathFactory):
    """name -> (arch, full tensors, saved HF directory), saved once per module."""
    saved = {}
    for name in RANDOM_CONFIGS:
        arch = read_arch("random", name)
        tensors = load_all("random", name, arch.num_layers)
        directory = save_hf_directory(tmp_path_factory.mktemp(name), arch, tensors)
        saved[name] = (arch, tensors, directory)
    return saved
