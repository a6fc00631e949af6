"""Engine variants compared in one benchmark: `--runs "pp=2,threads=1;pp=1,threads=2"`.

A run is a label plus config overrides. Keys are dotted config keys
(`scheduler.max_num_seqs=32`) or a short alias (`pp`, `threads`); values are
TOML values (lists in brackets: `parallel.layer_split=[18,12]`). A base `layer_split` made for another pp_size is dropped (even split). Each run gets its own TOML file: the base config's tables with
the overrides applied and `server.port = 0`, validated by `config_from_dict`
before anything is launched. A run that sets `pp` and not `dp` is one engine
of that many stages (`parallel.dp_size = 1`), whatever the base's replicas
(the default deployment's are two), as `asyncpp serve -pp N` on the default.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncpp.bench.stage_kill import StageKill
from asyncpp.config import EngineConfig, config_from_dict
from asyncpp.toml_write import to_toml  # noqa: F401  (re-exported: derived configs are written with it)

ALIASES = {
    "pp": "parallel.pp_size",
    "dp": "parallel.dp_size",
    "threads": "parallel.num_threads",
    "graphs": "model.cuda_graphs",
    "async_output": "scheduler.async_output",
    "backend": "bench.backend",  # not a config key: how the bench talks to this run (native | openai)
    "tree": "bench.tree",  # not a config key: the checkout of asyncpp this run's engine imports (another revision)
    "kill": "bench.kill_stage",  # not a config key: RANK@SECONDS, a stage killed mid-run (`asyncpp.bench.stage_kill`)
    "structured": "bench.structured",  # not a config key: json, every request under the bench's JSON schema
}
# `structured=json`: a list of at least 64 word records, longer than any benchmark's answer: the
# grammar constrains every token generated (`asyncpp.structured`).
BENCH_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 16}, "count": {"type": "integer"}, "kind": {"enum": ["noun", "verb", "other"]}},
        "required": ["word", "count", "kind"],
        "additionalProperties": False,
    },
    "minItems": 64,
}


@dataclass(frozen=True)
class RunSpec:
    label: str
    overrides: tuple[tuple[str, Any], ...]  # (dotted key, value)

    def backend(self, default: str) -> str:
        """`native` (AsyncClient) or `openai` (the HTTP front end): `backend=...` in the run, else `default`."""
        value = dict(self.overrides).get("bench.backend", default)
        if value not in ("native", "openai"):
            raise ValueError(f"run {self.label!r}: backend must be native or openai, got {value!r}")
        return value

    def stage_kill(self) -> StageKill | None:
        """`kill=RANK@SECONDS`: that stage is killed that long after the requests start; None: not."""
        value = dict(self.overrides).get("bench.kill_stage")
        return None if value is None else StageKill.parse(value)

    def structured_outputs(self) -> dict[str, Any] | None:
        """`structured=json`: what every request is generated under; None: free text."""
        value = dict(self.overrides).get("bench.structured")
        if value is None:
            return None
        if value != "json":
            raise ValueError(f"run {self.label!r}: structured must be json, got {value!r}")
        return {"json": BENCH_SCHEMA}

    def tree(self) -> Path | None:
        """`tree=PATH`: the run's engine imports asyncpp from that checkout (a worktree of another
        revision: `git worktree add /tmp/before HEAD~3`), so revisions are compared in one interleaved
        run; None: this one's."""
        value = dict(self.overrides).get("bench.tree")
        if value is None:
            return None
        tree = Path(str(value)).resolve()
        if not (tree / "asyncpp" / "launch.py").is_file():
            raise ValueError(f"run {self.label!r}: tree {str(tree)!r} holds no asyncpp checkout")
        return tree


def parse_runs(text: str | None) -> list[RunSpec]:
    """`"pp=2,threads=1;pp=1"` -> two runs; None or "" -> one run of the config as it is."""
    if not text or not text.strip():
        return [RunSpec("config", ())]
    runs = []
    for chunk in text.split(";"):
        chunk = chunk.strip()
        if not chunk:
            continue
        overrides = []
        for item in _split_top_level(chunk):
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"run {chunk!r}: expected key=value, got {item!r}")
            key = ALIASES.get(key.strip(), key.strip())
            if key.count(".") != 1:
                raise ValueError(f"run {chunk!r}: {key!r} is neither an alias {sorted(ALIASES)} nor section.key")
            overrides.append((key, _parse_value(raw.strip())))
        runs.append(RunSpec(chunk, tuple(overrides)))
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate runs in {text!r}")
    return runs


def run_sections(base_toml: str | Path, run: RunSpec) -> dict[str, dict[str, Any]]:
    sections = tomllib.loads(Path(base_toml).read_text())
    for key, value in run.overrides:
        section, name = key.split(".")
        if section == "bench":
            continue
        sections.setdefault(section, {})[name] = value
    parallel = sections.setdefault("parallel", {})
    keys = {key for key, _ in run.overrides}
    if "parallel.pp_size" in keys and "parallel.dp_size" not in keys:
        parallel["dp_size"] = 1  # pp=N alone: one engine of N stages
    split = parallel.get("layer_split") or []
    is_explicit = any(key == "parallel.layer_split" for key, _ in run.overrides)
    if split and len(split) != parallel.get("pp_size", 1) and not is_explicit:
        parallel["layer_split"] = []  # the base split was for another pp_size: split evenly
    sections.setdefault("server", {})["port"] = 0
    return sections


def validate(sections: dict[str, dict[str, Any]]) -> EngineConfig:
    return config_from_dict(sections)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: "pp=2,parallel.layer_split=[18,12]" -> two items."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: a string
