"""`python -m asyncpp.launch --config pd.toml`: a prefill engine, a decode engine, the router in front.

The launcher hands a config with a `[disagg]` table here (`asyncpp.launch.main`).
It writes each engine's derived config (`asyncpp.disagg.config`) into a
temporary directory, starts both engines as child launchers on free ports
(each with its own stages; CPUs split between them when there are enough),
waits for their ready lines, exchanges the engines' KV handshakes, starts
the HTTP front end against the router when asked, prints the router's ready
line and serves (or answers `--prompt` once). The router's `server.port` is
bound, and `server.http_port` tried, before anything starts: a port in use
is exit 2 naming its key.

An engine that exits fails its requests ("engine_dead") and leaves the router
serving, unhealthy, until the launcher itself is stopped. Ctrl-C / SIGTERM:
the router drains within `server.grace_period_s`, then the engines are
stopped; the children are always reaped and the directory removed. Exit code:
0, or 1 when an engine died (or the one-shot failed), 2 for a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from asyncpp.config import EngineConfig, with_http_overrides
from asyncpp.disagg.child import EngineChild, EngineStartError
from asyncpp.disagg.config import ROLES, DisaggConfig, load_disagg_config, split_cpus
from asyncpp.disagg.lifecycle import Deployment, exit_code, on_signals
from asyncpp.disagg.link import EngineLink
from asyncpp.disagg.router import PDRouter
from asyncpp.front_ends import bind_client_port, check_http_port
from asyncpp.logging import get_logger
from asyncpp.runtime.cpu_affinity import usable_cpu_ids
from asyncpp.toml_write import to_toml
from asyncpp.wire.client_auth import ClientAccess, new_secret

MAX_FRAME_BYTES = 8 * 1024 * 1024  # as an engine's


def main(ns: argparse.Namespace) -> int:
    """After `asyncpp.launch` parsed the command line and configured logging."""
    try:
        pd = load_disagg_config(ns.config)
        config = with_http_overrides(pd.shared, ns.http_host, ns.http_port, ns.api_key)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return exit_code(run(pd, config, ns))


def engine_files(
    pd: DisaggConfig, workdir: Path, engine_secret: str
) -> tuple[dict[str, Path], dict[str, tuple[int, ...] | None]]:
    """Each engine's config file (in `workdir`, the launcher's own: it holds the engine secret), and
    its CPUs (None: both share the launcher's)."""
    cpu_ids = usable_cpu_ids()
    shares = split_cpus(cpu_ids, [pd.num_cpus_needed(role) for role in ROLES]) if pd.section.split_cpus else None
    paths, cpus = {}, {}
    for i, role in enumerate(ROLES):
        sections = pd.engines[role]
        # Both engines take the same engine secret, and so does the router's link to each.
        sections = {**sections, "server": {**sections.get("server", {}), "engine_secret": engine_secret}}
        if shares is None:  # sharing every CPU: two engines pinning threads to the same cores would collide
            sections = {**sections, "parallel": {**sections.get("parallel", {}), "pin_threads": False}}
        paths[role] = workdir / f"{role}.toml"
        paths[role].write_text(to_toml(sections))
        cpus[role] = shares[i] if shares is not None else None
    return paths, cpus


async def run(pd: DisaggConfig, config: EngineConfig, ns: argparse.Namespace) -> int:
    """`config`: the shared tables with the command line's HTTP settings; its [server] is the router's."""
    log = get_logger(role="pd_launch")
    # Both ports before any engine starts: one in use is exit 2 naming its key, not a traceback later.
    check_http_port(config)
    port = config.server.port if ns.port is None else ns.port
    # The router's clients: those with the client secret (none holds the engine role here).
    queue = bind_client_port(config.server.host, port, MAX_FRAME_BYTES, ClientAccess(config.server.client_secret))
    main_task = asyncio.current_task()
    on_signals(main_task.cancel)  # during start-up: stop, reaping what started
    workdir = Path(tempfile.mkdtemp(prefix="asyncpp-pd-"))
    engine_secret = config.server.engine_secret or new_secret()
    paths, cpus = engine_files(pd, workdir, engine_secret)
    log_args = ["--log-format", ns.log_format, "--log-level", ns.log_level]
    log_args += ["--log-file", ns.log_file] if ns.log_file else []
    children = [
        EngineChild(role, ["--config", str(paths[role]), *log_args], cpus=cpus[role],
                    prefix_output=ns.log_format == "console")
        for role in ROLES
    ]  # fmt: skip
    deployment = Deployment(queue, children, workdir)
    try:
        for child in children:
            await child.start()
        timeout_s = pd.section.start_timeout_s
        addresses = await asyncio.gather(*(child.wait_ready(timeout_s) for child in children))
        links = [
            EngineLink(role, address, engine_secret=engine_secret, health_interval_s=pd.section.health_interval_s,
                       health_timeout_s=pd.section.health_timeout_s)
            for role, address in zip(ROLES, addresses)
        ]  # fmt: skip
        deployment.router = router = PDRouter(queue, *links, handover=pd.section.handover)
        try:
            await router.connect(timeout_s)
        except (TimeoutError, RuntimeError) as e:  # an engine that does not answer, or refuses the other
            raise EngineStartError(f"KV handshakes: {e}") from e
        deployment.watch(links)
        log.info("pd_ready", address=router.address, prefill=addresses[0], decode=addresses[1],
                 cpus={role: list(c) if c else None for role, c in cpus.items()})  # fmt: skip
        ready = (f"asyncpp ready: clients connect to {router.address} (prefill/decode router: "
                 f"prefill {addresses[0]}, decode {addresses[1]})")  # fmt: skip
        return await deployment.serve(config, ns, str(paths["decode"]), ready)
    except asyncio.CancelledError:
        log.info("pd_start_interrupted")
        return 1
    finally:
        on_signals(lambda: log.warning("pd_stopping_already"))  # a second Ctrl-C must not cut the clean-up short
        await deployment.stop(config.server.grace_period_s)
        log.info("pd_stopped")
