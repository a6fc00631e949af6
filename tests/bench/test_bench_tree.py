"""`tree=PATH` in a benchmark's runs: that run's engine imports asyncpp from another checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncpp.bench.engine_proc import launched_engine
from asyncpp.bench.runs import parse_runs, run_sections

FAKE_LAUNCH = """
import asyncpp, time
print("clients connect to", asyncpp.__file__, flush=True)
time.sleep(60)
"""


def _fake_checkout(root: Path) -> Path:
    (root / "asyncpp").mkdir(parents=True)
    (root / "asyncpp" / "__init__.py").write_text("")
    (root / "asyncpp" / "launch.py").write_text(FAKE_LAUNCH)
    return root


def test_a_tree_names_a_checkout_and_is_no_config_key(tmp_path):
    tree = _fake_checkout(tmp_path / "before")
    before, here = parse_runs(f"tree={tree};tree=.")
    assert before.tree() == tree.resolve() and here.tree() == Path(".").resolve()
    assert parse_runs("pp=2")[0].tree() is None
    base = tmp_path / "base.toml"
    base.write_text('[model]\nsource = "random"\npath = "tiny-llama"\n')
    assert "bench" not in run_sections(base, before)


def test_a_tree_without_asyncpp_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no asyncpp checkout"):
        parse_runs(f"tree={tmp_path}")[0].tree()


def test_the_engine_imports_asyncpp_from_the_tree(tmp_path):
    tree = _fake_checkout(tmp_path / "before")
    config = tmp_path / "engine.toml"
    config.write_text("")
    with launched_engine(config, ready_timeout_s=60, stop_timeout_s=10, tree=tree) as engine:
        assert engine.address == str(tree / "asyncpp" / "__init__.py")
