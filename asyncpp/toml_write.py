"""`to_toml`: config sections (tables of plain values) written back as TOML, for derived config files."""

from __future__ import annotations

from typing import Any


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (kv_transfer.options, kv_transfer.children's entries)
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (int, float)):
        return repr(v)
    raise ValueError(f"cannot write {v!r} as TOML")
