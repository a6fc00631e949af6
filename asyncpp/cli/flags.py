"""`asyncpp serve`'s flags: vLLM's names first, then SGLang's and llama-server's spellings of the same setting.

Each `Flag` names the config key it sets (`section.field`), so the parser,
`--help` and the generated CLI reference come from this one table. A flag
the user did not give leaves its key to `--config` (or the default
deployment, `configs/default.toml`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_PORT = 8000  # vLLM's


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # vLLM's spelling first, then the aliases
    key: str  # "section.field" the value sets
    help: str
    type: Callable[[str], Any] | None = str
    metavar: str | None = None
    is_switch: bool = False  # --x / --no-x


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (vLLM's `--speculative-config '{...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def positive_int(text: str) -> int:
    value = _integer(text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = _integer(text, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def http_port_number(text: str) -> int:
    """`asyncpp serve --port`: a real port (the config's 0, no HTTP server, makes no sense for a server)."""
    value = port_number(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be in 1..65535 (asyncpp serve always serves HTTP), got 0")
    return value


FLAGS: tuple[Flag, ...] = (
    Flag(("--model", "--model-path", "-m"), "model.path",
         "the model: a GGUF file, a Hugging Face directory, or an installed model package (as the positional MODEL)",
         metavar="MODEL"),
    Flag(("--host",), "server.http_host", "the HTTP server's address (default 127.0.0.1; another needs --api-key)",
         metavar="HOST"),
    Flag(("--port",), "server.http_port", f"the HTTP server's port (default {DEFAULT_PORT})", http_port_number,
         metavar="PORT"),
    Flag(("--api-key",), "server.api_key", 'clients must send "Authorization: Bearer KEY"', metavar="KEY"),
    Flag(("--served-model-name", "--alias", "-a"), "server.served_model_name",
         'the model name clients use ("model" in requests; default: named after the model file)', metavar="NAME"),
    Flag(("--pipeline-parallel-size", "-pp", "--pp-size"), "parallel.pp_size",
         "pipeline stages per engine, one process each (without -dp: one engine of N stages)", positive_int,
         metavar="N"),
    Flag(("--data-parallel-size", "-dp", "--dp-size", "--dp"), "parallel.dp_size",
         "engines (replicas) behind one router that sends each request where its first token comes soonest",
         positive_int, metavar="N"),
    Flag(("--long-prompt-pp-size",), "parallel.long_prompt_pp_size",
         "with -dp: one more engine of N stages, on every core, takes the long prompts (0 = none)",
         non_negative_int, metavar="N"),
    Flag(("--long-prompt-tokens",), "parallel.long_prompt_tokens",
         "prompts of at least N tokens are long (default 512)", positive_int, metavar="N"),
    Flag(("--max-model-len", "--context-length", "--ctx-size", "-c"), "model.max_model_len",
         "the longest prompt plus answer, in tokens", positive_int, metavar="N"),
    Flag(("--dtype",), "model.dtype", "auto | float32 | bfloat16 | float16 (auto: bfloat16 where the CPU computes it)",
         metavar="DTYPE"),
    Flag(("--max-num-seqs", "--max-running-requests", "--parallel", "-np"), "scheduler.max_num_seqs",
         "requests running at once", positive_int, metavar="N"),
    Flag(("--enable-prefix-caching",), "cache.enable_prefix_caching", "reuse the KV of shared prompt prefixes",
         None, is_switch=True),
    Flag(("--speculative-config",), "speculative", 'speculative decoding as JSON, e.g. \'{"method": "ngram", '
         '"num_speculative_tokens": 4}\'', json_object, metavar="JSON"),
    Flag(("--kv-transfer-config",), "kv_transfer", 'the KV connector as JSON, e.g. \'{"kv_connector": "offload", '
         '"store_size_mb": 512}\'', json_object, metavar="JSON"),
    Flag(("--engine-port",), "server.port", "the engine's own client port (AsyncClient; default: any free one)",
         port_number, metavar="PORT"),
)


def dest(flag: Flag) -> str:
    return flag.key.replace(".", "__")
