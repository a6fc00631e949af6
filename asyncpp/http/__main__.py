"""`python -m asyncpp.http --config FILE --engine ADDRESS`: the OpenAI-compatible HTTP server.

The launcher starts it when `server.http_port` (or `--http-port`) is set; it
can also be started by hand next to a running engine. It tokenizes with the
config's model and talks to the engine through `AsyncClient`. On SIGINT or
SIGTERM it stops taking requests and gives the open ones
`server.grace_period_s` before it ends them (`build_app`'s `begin_shutdown`).

It serves one engine run (`http.engine_guard`): the launcher passes its own
(`--engine-id`), and the server stops (exit 1) when that engine's connection
is lost or another engine is found at the address; started by hand, it
serves the first engine it reaches and stops if another takes its place.
`--ready-fd N`: write "listening" to that file descriptor once the port is
bound (the launcher waits for it: an exit before it is a port it could not
bind, or another start-up failure).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import uvicorn

from asyncpp.config import ConfigError, EngineConfig, load_config, with_http_overrides
from asyncpp.engine.input_processor import InputProcessor
from asyncpp.http.app import HttpSettings, build_app
from asyncpp.logging import configure_logging
from asyncpp.tokenizer import load_tokenizer
from asyncpp.weights import read_arch


def served_model_name(config: EngineConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    m = config.model
    if m.source == "gguf" and not m.path:
        return "SmolLM2-135M-Instruct"
    if m.source == "random":
        return m.path or "tiny-llama"
    path = pathlib.Path(m.path)
    return path.stem if path.suffix == ".gguf" else path.name


def max_in_flight(config: EngineConfig) -> int:
    """Requests the server takes at once: what every engine behind it runs (`dp_size` replicas of
    `max_num_seqs` each, and a long-prompt one, behind a data-parallel router) plus
    `server.max_queued_requests`."""
    return config.scheduler.max_num_seqs * len(config.parallel.engine_stages) + config.server.max_queued_requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.http", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--engine", required=True, help="the engine's client address, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--host", help="override server.http_host")
    ap.add_argument("--port", type=int, help="override server.http_port")
    ap.add_argument("--api-key", help="override server.api_key")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--engine-id", help="serve only the engine run with this id (stats' run_id); stop when it is gone")
    ap.add_argument("--ready-fd", type=int, help="write 'listening' to this file descriptor once listening")
    ns = ap.parse_args(argv)
    configure_logging("console", ns.log_level, None)
    try:
        config = with_http_overrides(load_config(ns.config), ns.host, ns.port, ns.api_key)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    arch = read_arch(config.model.source, config.model.path_or_none)
    tokenizer = load_tokenizer(config.model.source, config.model.path_or_none, arch.vocab_size)
    processor = InputProcessor(tokenizer, arch.vocab_size, config.model.max_model_len)
    server = config.server
    settings = HttpSettings(
        ns.engine, served_model_name(config), config.model.max_model_len, server.api_key or None,
        metrics_require_key=server.metrics_require_key,
        max_in_flight=max_in_flight(config),
        max_frame_bytes=server.max_frame_bytes, grace_period_s=server.grace_period_s,
        client_secret=server.client_secret, engine_id=ns.engine_id, exits_when_engine_lost=ns.engine_id is not None,
    )  # fmt: skip
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:  # the engine is gone for good: stop, as on SIGTERM
        fatal.append(reason)
        uvicorn_server.should_exit = True

    app = build_app(settings, processor, on_fatal)
    uvicorn_config = uvicorn.Config(
        app, host=server.http_host, port=server.http_port, log_level=ns.log_level,
        loop="uvloop", access_log=False, timeout_graceful_shutdown=2,
    )  # fmt: skip
    uvicorn_server = _GracefulServer(uvicorn_config, app.state.begin_shutdown, ns.ready_fd)
    uvicorn_server.run()
    if fatal:
        print(f"error: {fatal[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, with the app's own shutdown first: uvicorn alone would wait two seconds,
    then cut open streams without a word and answer pending requests with a plain-text 500."""

    def __init__(self, config: uvicorn.Config, begin_shutdown, ready_fd: int | None = None) -> None:
        super().__init__(config)
        self.begin_shutdown = begin_shutdown
        self.ready_fd = ready_fd

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)  # a port it cannot bind: it exits here (code 1)
        if self.ready_fd is not None and not self.should_exit:
            os.write(self.ready_fd, b"listening\n")
            os.close(self.ready_fd)
            self.ready_fd = None

    async def shutdown(self, sockets=None) -> None:
        await self.begin_shutdown(lambda: self.force_exit)  # a second Ctrl-C: no more waiting
        await super().shutdown(sockets)


if __name__ == "__main__":
    sys.exit(main())
