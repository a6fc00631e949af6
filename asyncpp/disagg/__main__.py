"""`python -m asyncpp.disagg --prefill ADDRESS --decode ADDRESS`: the router alone, in front of
two engines started some other way (`python -m asyncpp.launch` with `kv_transfer.kv_role` set).

It talks to the engines in the engine role: both must be started with the
same `server.engine_secret`, which the router reads from the environment
variable ASYNCPP_ENGINE_SECRET (not the command line, which other users see);
its own clients present ASYNCPP_CLIENT_SECRET if set (then it may bind off
loopback).

It waits for both engines and gives each the other's KV handshake, prints
"asyncpp ready: clients connect to ADDRESS" and serves until Ctrl-C /
SIGTERM. An engine that stops answering fails its requests and is refused
until it answers again (restarted at the same address), when the handshakes
are exchanged anew. Exit code 0, or 1 when an engine was dead at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import uvloop

from asyncpp.disagg.config import HANDOVERS, DisaggSection
from asyncpp.disagg.deploy import MAX_FRAME_BYTES
from asyncpp.disagg.link import EngineLink
from asyncpp.disagg.router import PDRouter
from asyncpp.logging import configure_logging
from asyncpp.wire.client_auth import ClientAccess
from asyncpp.wire.queues import RouterQueue

ENGINE_SECRET_ENV = "ASYNCPP_ENGINE_SECRET"
CLIENT_SECRET_ENV = "ASYNCPP_CLIENT_SECRET"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DisaggSection()
    ap = argparse.ArgumentParser(prog="python -m asyncpp.disagg", description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill engine's client address (tcp://host:port)")
    ap.add_argument("--decode", required=True, help="the decode engine's client address")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5557, help="0 = any free port")
    ap.add_argument("--health-interval-s", type=float, default=defaults.health_interval_s)
    ap.add_argument("--health-timeout-s", type=float, default=defaults.health_timeout_s)
    ap.add_argument("--start-timeout-s", type=float, default=60.0, help="both engines must answer within it")
    ap.add_argument("--grace-period-s", type=float, default=5.0)
    ap.add_argument("--handover", choices=HANDOVERS, default=defaults.handover, help="when the decode engine gets a request")
    ap.add_argument("--log-format", choices=("console", "json"), default="console")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


async def run(ns: argparse.Namespace) -> int:
    health = {"health_interval_s": ns.health_interval_s, "health_timeout_s": ns.health_timeout_s}
    engine_secret, client_secret = os.environ.get(ENGINE_SECRET_ENV, ""), os.environ.get(CLIENT_SECRET_ENV, "")
    if not engine_secret:
        print(f"error: set {ENGINE_SECRET_ENV} to the engines' server.engine_secret", file=sys.stderr)
        return 2
    prefill = EngineLink("prefill", ns.prefill, engine_secret=engine_secret, **health)
    decode = EngineLink("decode", ns.decode, engine_secret=engine_secret, **health)
    try:
        queue = RouterQueue(f"tcp://{ns.host}:{ns.port}", MAX_FRAME_BYTES, ClientAccess(client_secret))
    except ValueError as e:
        print(f"error: {e} (for this router: the environment variable {CLIENT_SECRET_ENV})", file=sys.stderr)
        return 2
    router = PDRouter(queue, prefill, decode, handover=ns.handover)
    try:
        try:
            await router.connect(ns.start_timeout_s)
        except (TimeoutError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(router.drain_and_stop(ns.grace_period_s)))
        print(f"asyncpp ready: clients connect to {router.address} (prefill/decode router: "
              f"prefill {ns.prefill}, decode {ns.decode})", file=sys.stderr, flush=True)  # fmt: skip
        await router.serve()
        return 0 if router.is_healthy else 1
    finally:
        await router.close()


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    configure_logging(ns.log_format, ns.log_level, None)
    return uvloop.run(run(ns))


if __name__ == "__main__":
    sys.exit(main())
