"""`Deployment`: engines started as child launchers behind a router, from ready to stopped.

Both launchers of several engines (`asyncpp.disagg.deploy`,
`asyncpp.dp.deploy`) start their children and their router their own way,
then hand the pieces here: `serve` starts the HTTP front end when asked
(against the router), prints the router's ready line only once SIGINT and
SIGTERM drain the router (whoever reads that line may signal at once), and
serves until drained, or answers `--prompt` once; `stop` always runs, in
order: the HTTP front end, the router (or its bare client port, if it never
started), the children (SIGTERM within their grace period plus a margin,
then SIGKILL), the working directory. `exit_code` runs a launcher's
coroutine and turns what stops it early into the exit code and one line.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from asyncpp.config import ConfigError, EngineConfig
from asyncpp.disagg.child import EngineChild, EngineStartError, watch_exit
from asyncpp.disagg.link import EngineLink
from asyncpp.front_ends import http_url, one_shot, start_http, stop_http
from asyncpp.wire.queues import RouterQueue

CHILD_STOP_MARGIN_S = 15.0  # beyond an engine's grace period before it is killed


def exit_code(launcher: Coroutine[Any, Any, int]) -> int:
    """Run `launcher` to its exit code; a bad config or a port in use found before the engines start
    is exit 2, an engine that cannot start its own (1, or 2 for its bad config), each said in one line."""
    try:
        return uvloop.run(launcher)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if e.exit_code == 2 else 1


def on_signals(handler: Callable[[], Any]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handler)


@dataclass
class Deployment:
    queue: RouterQueue  # the router's client port, bound before anything started
    children: list[EngineChild]
    workdir: Path  # the launcher's own: the engines' configs (they hold the engine secret)
    router: Any = None  # a `RouterBase`, once made
    http: asyncio.subprocess.Process | None = None
    watchers: list[asyncio.Task] = field(default_factory=list)

    def watch(self, links: list[EngineLink]) -> None:
        """An engine process that exits while the launcher runs: its link is marked gone for good."""
        self.watchers = [asyncio.create_task(watch_exit(c, link.mark_gone)) for c, link in zip(self.children, links)]

    async def serve(self, config: EngineConfig, ns: argparse.Namespace, http_config: str, ready_line: str) -> int:
        """Exit code: 0, or 1 when an engine died (or the one-shot failed)."""
        router, grace_s = self.router, config.server.grace_period_s
        on_signals(lambda: asyncio.ensure_future(router.drain_and_stop(grace_s)))
        if config.server.http_port:
            self.http = await start_http(http_config, config, router.address, router.router_id)
            print(f"asyncpp http: OpenAI API on {http_url(config)}/v1", file=sys.stderr, flush=True)
        print(ready_line, file=sys.stderr, flush=True)  # only now: its reader may signal us at once
        serving = asyncio.create_task(router.serve())
        ok = True
        if ns.prompt is not None:
            ok = await one_shot(router.address, ns.prompt, ns.max_tokens, config.server.client_secret)
            await router.drain_and_stop(grace_s)
        await serving
        return 0 if ok and router.is_healthy else 1

    async def stop(self, grace_period_s: float) -> None:
        for task in self.watchers:
            task.cancel()
        if self.http is not None:
            await stop_http(self.http)
        if self.router is not None:
            await self.router.close()
        else:
            self.queue.close()
        await asyncio.gather(*(child.stop(grace_period_s + CHILD_STOP_MARGIN_S) for child in self.children))
        shutil.rmtree(self.workdir, ignore_errors=True)
