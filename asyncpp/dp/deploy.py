"""`python -m asyncpp.launch --config FILE` with `parallel.dp_size = N`: N engines behind one router.

`asyncpp.launch.serve` hands such a config here. The router's `server.port`
is bound, and `server.http_port` tried, before anything starts (a port in use
is exit 2 naming its key). Each replica's derived config
(`asyncpp.dp.config`) goes into a temporary directory of the launcher's own
(it holds the engine secret); the replicas start as child launchers on free
ports, each bound to CPUs of its own when there are enough (a long-prompt
replica, `parallel.long_prompt_pp_size`, gets every CPU), and once every
one is ready and healthy the HTTP front end (when asked) starts against the
router, the router prints its ready line and serves (or answers `--prompt`
once).

A replica that exits fails its requests ("engine_dead"); the router goes on
with the others, unhealthy, until the launcher is stopped. Ctrl-C / SIGTERM:
the router drains within `server.grace_period_s`, then the replicas are
stopped; the children are always reaped and the directory removed. Exit code:
0, or 1 when a replica died (or the one-shot failed), 2 for a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import tomllib
from pathlib import Path

from asyncpp.config import EngineConfig
from asyncpp.disagg.child import EngineChild, EngineStartError
from asyncpp.disagg.lifecycle import Deployment, exit_code, on_signals
from asyncpp.disagg.link import EngineLink
from asyncpp.dp.config import check_dp, check_dp_memory, long_prompt_sections, replica_cpus, replica_sections
from asyncpp.dp.placement import LongPrompts
from asyncpp.dp.router import LOG_ROLE, DPRouter
from asyncpp.front_ends import bind_client_port, check_http_port
from asyncpp.logging import get_logger
from asyncpp.runtime.cpu_affinity import usable_cpu_ids
from asyncpp.toml_write import to_toml
from asyncpp.wire.client_auth import ClientAccess, new_secret

MAX_FRAME_BYTES = 8 * 1024 * 1024  # as an engine's
START_TIMEOUT_S = 600.0  # every replica ready (stages loaded) and healthy within it
HEALTH_INTERVAL_S = 0.5  # a health check per replica this often
HEALTH_TIMEOUT_S = 2.0  # no reply within it: the replica is dead


def main(config: EngineConfig, ns: argparse.Namespace) -> int:
    """After `asyncpp.launch` read `config` (from `ns.config`, with the command line's HTTP settings)
    and configured logging."""
    return exit_code(run(config, ns))  # a refused setting, a bad replica config or a port in use: exit 2


def replica_files(
    config: EngineConfig, config_path: str, workdir: Path, engine_secret: str, cpu_ids: list[int]
) -> tuple[list[Path], list[tuple[int, ...] | None]]:
    """Each replica's config file (in `workdir`) and its CPUs of `cpu_ids` (None: they share the
    launcher's); the long-prompt replica's last, on every CPU."""
    sections = tomllib.loads(Path(config_path).read_text())
    parallel = config.parallel
    shares = replica_cpus(cpu_ids, parallel.dp_size, parallel.pp_size * parallel.num_threads)
    paths = []
    for i in range(parallel.dp_size):
        path = workdir / f"replica-{i}.toml"
        path.write_text(to_toml(replica_sections(sections, i, engine_secret, share_cpus=shares is None)))
        paths.append(path)
    cpus = list(shares) if shares is not None else [None] * parallel.dp_size
    if parallel.long_prompt_pp_size:
        path = workdir / "long-prompts.toml"
        path.write_text(to_toml(long_prompt_sections(sections, parallel.long_prompt_pp_size, engine_secret)))
        paths.append(path)
        cpus.append(None)
    return paths, cpus


async def run(config: EngineConfig, ns: argparse.Namespace) -> int:
    log = get_logger(role="dp_launch")
    check_dp(config)
    check_dp_memory(config)
    check_http_port(config)  # both ports before any replica starts
    port = config.server.port if ns.port is None else ns.port
    queue = bind_client_port(config.server.host, port, MAX_FRAME_BYTES, ClientAccess(config.server.client_secret))
    on_signals(asyncio.current_task().cancel)  # during start-up: stop, reaping what started
    deployment = Deployment(queue, [], Path(tempfile.mkdtemp(prefix="asyncpp-dp-")))
    try:
        engine_secret = config.server.engine_secret or new_secret()
        cpu_ids = usable_cpu_ids()
        paths, cpus = replica_files(config, ns.config, deployment.workdir, engine_secret, cpu_ids)
        p = config.parallel
        if cpus[0] is None:  # too few CPUs for a share each: their threads compete for every core
            log.warning("dp_cpus_shared", num_replicas=p.dp_size, threads_each=p.pp_size * p.num_threads,
                        num_cpus=len(cpu_ids), hint="fewer replicas, or parallel.pp_size = 1")  # fmt: skip
        log_args = ["--log-format", ns.log_format, "--log-level", ns.log_level]
        log_args += ["--log-file", ns.log_file] if ns.log_file else []
        names = [f"replica {i}" for i in range(p.dp_size)] + ["long-prompt replica"] * bool(p.long_prompt_pp_size)
        deployment.children = children = [
            EngineChild(name, ["--config", str(path), *log_args], cpus=cpus[i],
                        prefix_output=ns.log_format == "console", log_role="dp_launch")
            for i, (name, path) in enumerate(zip(names, paths))
        ]  # fmt: skip
        for child in children:
            await child.start()
        addresses = await asyncio.gather(*(child.wait_ready(START_TIMEOUT_S) for child in children))
        links = [
            EngineLink(child.role, address, engine_secret=engine_secret, health_interval_s=HEALTH_INTERVAL_S,
                       health_timeout_s=HEALTH_TIMEOUT_S, log_role=LOG_ROLE)
            for child, address in zip(children, addresses)
        ]  # fmt: skip
        long_prompts = LongPrompts(p.dp_size, p.long_prompt_tokens) if p.long_prompt_pp_size else None
        deployment.router = router = DPRouter(queue, links, config.scheduler.max_num_batched_tokens, long_prompts)
        try:
            await router.connect(START_TIMEOUT_S)
        except TimeoutError as e:
            raise EngineStartError(str(e)) from e
        deployment.watch(links)
        log.info("dp_ready", address=router.address, replicas=addresses, cpus=[list(c) if c else None for c in cpus])
        each = f"; each {children[0].ready_detail}" if children[0].ready_detail else ""
        long = (f"; prompts of {p.long_prompt_tokens}+ tokens: {p.long_prompt_pp_size} stages, {addresses[-1]}"
                if long_prompts else "")  # fmt: skip
        ready = (f"asyncpp ready: clients connect to {router.address} (data-parallel router: "
                 f"{p.dp_size} replicas, {', '.join(addresses[:p.dp_size])}{long}{each})")  # fmt: skip
        return await deployment.serve(config, ns, ns.config, ready)  # its file: dp_size sets its in-flight limit
    except asyncio.CancelledError:
        log.info("dp_start_interrupted")
        return 1
    finally:
        on_signals(lambda: log.warning("dp_stopping_already"))  # a second Ctrl-C must not cut the clean-up short
        await deployment.stop(config.server.grace_period_s)
        log.info("dp_stopped")
