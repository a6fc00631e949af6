"""`python -m asyncpp.launch --config FILE`: start the engine and its stages, serve clients.

The composition root: the only place that sees the whole config. It spawns
one process per pipeline stage, waits for every ready-ack (the engine uses the
smallest KV capacity any stage reports) and every stage's KV handshake (handed
to the KV connector before any request), prints where clients connect and
serves until Ctrl-C / SIGTERM (drain within the grace period) or until a
stage dies (exit 1). Children are always reaped and shared memory unlinked.
With `--prompt`, it streams one chat answer through `AsyncClient` and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import signal
import sys
import time

import torch
import uvloop

from asyncpp.config import ConfigError, EngineConfig, load_config, with_http_overrides
from asyncpp.device import check_devices, is_cuda
from asyncpp.disagg.config import is_disagg_config
from asyncpp.engine.compute_plan import ComputePlan, resolve_compute_plan
from asyncpp.engine.engine import EngineCore
from asyncpp.engine.startup import (
    EngineCapacity,
    kv_connector_context,
    log_shift_layers,
    resolve_capacity,
    set_stage_handshakes,
)
from asyncpp.engine.layer_balance import LayerBalancer
from asyncpp.front_ends import (
    bind_client_port,
    check_http_port,
    client_access,
    http_url,
    one_shot,
    start_http,
    stop_http,
)
from asyncpp.host_memory import check_host_memory
from asyncpp.kv_transfer.base import ConnectorContext
from asyncpp.kv_transfer.registry import create_scheduler_connector
from asyncpp.logging import configure_logging, get_logger
from asyncpp.profiling import profiled
from asyncpp.runtime.addresses import RunAddresses
from asyncpp.runtime.backends import create_stage_group
from asyncpp.runtime.cpu_affinity import stage_cpu_lists, usable_cpu_ids
from asyncpp.runtime.engine_server import EngineServer
from asyncpp.runtime.gc_heap import freeze_startup_heap
from asyncpp.runtime.stage_process import StageArgs
from asyncpp.speculative.proposer import create_proposer
from asyncpp.tokenizer import load_tokenizer
from asyncpp.transport import transport_for
from asyncpp.transport.token_ring import token_ring_spec
from asyncpp.weights import read_arch
from asyncpp.worker.shared_kv import SharedKVSegment
from asyncpp.worker.stage import step_graph_sizes

STAGE_READY_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.launch", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="deployment TOML file (see configs/)")
    ap.add_argument("--log-format", choices=("console", "json"), default="console")
    ap.add_argument("--log-level", help="debug | info | warning | error (default: info; warning with --prompt "
                    "and no --log-file)")
    ap.add_argument("--log-file", help="write JSON log lines of every process to this file")
    ap.add_argument("--port", type=int, help="override server.port (0 = any free port)")
    ap.add_argument("--http-port", type=int, help="serve the OpenAI API on this port (override server.http_port)")
    ap.add_argument("--http-host", help="override server.http_host")
    ap.add_argument("--api-key", help="require this key from HTTP clients (override server.api_key)")
    ap.add_argument("--prompt", help="one-shot: stream one chat answer to this prompt, then exit")
    ap.add_argument("--max-tokens", type=int, default=128, help="one-shot answer length limit")
    return ap.parse_args(argv)


def stage_args_for(
    config: EngineConfig,
    plan: ComputePlan,
    capacity: EngineCapacity,
    addresses: RunAddresses,
    ns,
    kv_connector: ConnectorContext | None = None,
) -> list[StageArgs]:
    pp_size = len(capacity.layer_ranges)
    devices = config.stage_devices
    cpu_lists = stage_cpus(config, pp_size)
    token_ring = None
    if config.uses_token_ring:  # stage 0 has no activation ring: its ring name is the token ring's
        token_ring = token_ring_spec(
            addresses.ring_name(0), transport_for(devices[0]), max_steps_in_flight(config),
            config.scheduler.max_num_seqs, devices[0], devices[-1],
        )  # fmt: skip
    return [
        StageArgs(
            pp_rank=rank,
            pp_size=pp_size,
            start_layer=start,
            end_layer=end,
            model_source=config.model.source,
            model_path=config.model.path_or_none,
            dtype=plan.dtype,
            isa=plan.isa,
            weight_format=plan.weight_format,
            device=devices[rank],
            peer_device=devices[rank - 1] if rank > 0 else devices[rank],
            graph_sizes=step_graph_sizes(config, devices[rank]),
            max_model_len=capacity.max_model_len,
            linear_kernel=config.model.linear_kernel,
            fma_min_rows=plan.fma_min_rows,
            num_threads=config.parallel.num_threads,
            block_size=config.cache.block_size,
            kv_cache_memory_mb=config.cache.kv_cache_memory_mb,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            num_ring_slots=max_steps_in_flight(config),
            nice=config.parallel.stage_nice,
            cpus=cpu_lists[rank],
            async_scheduling=config.scheduler.async_scheduling,
            async_output=config.uses_async_output,
            transport=transport_for(devices[rank]),
            addresses=addresses,
            kv_connector=kv_connector,
            kv_connector_module=config.kv_transfer.module,
            log_format=ns.log_format,
            log_level=ns.log_level,
            log_file=ns.log_file,
            run_layers=capacity.layer_ranges[rank],
            speculative=config.speculative if config.speculative.is_enabled else None,
            token_ring=token_ring if rank == 0 else None,
        )
        for rank, (start, end) in enumerate(capacity.held_ranges)
    ]


def stage_cpus(config: EngineConfig, pp_size: int) -> list[tuple[int, ...]]:
    """The CPUs each stage's threads are bound to (`parallel.pin_threads`); () per stage when unbound:
    pinning off, a GPU stage, or fewer CPUs than stage threads."""
    unbound = [()] * pp_size
    if not config.parallel.pin_threads or any(is_cuda(d) for d in config.stage_devices):
        return unbound
    return stage_cpu_lists(usable_cpu_ids(), pp_size, config.parallel.num_threads) or unbound


def max_steps_in_flight(config: EngineConfig) -> int:
    """One activation ring slot per step that can be in flight."""
    return config.steps_in_flight * (2 if config.scheduler.async_scheduling else 1)


async def run(config: EngineConfig, ns: argparse.Namespace) -> int:
    log = get_logger(role="launch")
    torch.set_num_threads(1)  # the engine process schedules; the stages compute
    check_devices(config)  # a CUDA device this machine lacks: exit 2 before anything starts
    arch = read_arch(config.model.source, config.model.path_or_none)
    check_host_memory(config, arch, config.parallel.engine_stages)  # cannot fit: exit 2 (a replica: its own share)
    plan = resolve_compute_plan(config.model, config.stage_devices, heads=arch.heads)  # so is an ISA level it lacks
    log.info("compute_plan", **plan.describe())
    log_shift_layers(config, log)
    capacity = resolve_capacity(config, arch, plan.dtype)
    # Both ports before the model loads: one in use is exit 2 naming its key, not a traceback later.
    check_http_port(config)
    port = config.server.port if ns.port is None else ns.port
    router = bind_client_port(config.server.host, port, config.server.max_frame_bytes, client_access(config))
    addresses = RunAddresses.create()
    server = None
    http = None
    kv_connector = None
    try:
        # Before any stage starts: a bad connector name or store fails here, naming its key.
        kv_ctx = kv_connector_context(config, arch, capacity.layer_ranges, addresses.run_id, plan.dtype)
        kv_connector = create_scheduler_connector(kv_ctx, config.kv_transfer.module)
        create_proposer(config.speculative)  # an unknown speculative.method: here, naming the key
    except Exception:
        router.close()
        shutil.rmtree(addresses.run_dir, ignore_errors=True)
        raise
    stages = create_stage_group(stage_args_for(config, plan, capacity, addresses, ns, kv_ctx), addresses, config.parallel)
    shared_kv: list[SharedKVSegment] = []
    try:
        stages.start()
        tokenizer = load_tokenizer(config.model.source, config.model.path_or_none, arch.vocab_size)
        t0 = time.monotonic()
        readies = await stages.wait_ready(STAGE_READY_TIMEOUT_S)
        num_blocks = config.cache.num_kv_blocks_override or min(r.num_kv_blocks for r in readies)
        capacity = dataclasses.replace(capacity, num_blocks=num_blocks)
        names = [addresses.shared_kv_name(i) for i in range(len(capacity.shift_windows))]
        shared_kv = [SharedKVSegment.create(spec) for spec in capacity.shared_kv_specs(arch, plan.dtype, names)]
        await stages.start_stages(num_blocks, [segment.spec for segment in shared_kv])
        # Every stage's runner is built (its caches registered) before the first plan; a connector
        # that refuses the stages' handshakes stops start-up here (exit 2, the stages shut down).
        handshakes = await stages.wait_handshakes(STAGE_READY_TIMEOUT_S)
        if kv_connector is not None:
            set_stage_handshakes(kv_connector, handshakes)
        core = EngineCore(config, arch, tokenizer, capacity, kv_connector)
        server = EngineServer(
            core,
            stages,
            router,
            max_cohorts=config.steps_in_flight,
            async_scheduling=config.scheduler.async_scheduling,
            grace_period_s=config.server.grace_period_s,
            compute_plan=plan,
            balancer=LayerBalancer(arch, capacity.layer_ranges, capacity.shift_windows) if capacity.is_shifting else None,
        )
        log.info(
            "engine_ready",
            address=router.address,
            pp_size=stages.pp_size,
            max_cohorts=server.max_cohorts,
            async_scheduling=server.async_scheduling,
            layer_ranges=capacity.layer_ranges,
            shift_windows=capacity.shift_windows,
            num_kv_blocks=num_blocks,
            kv_connector=config.kv_transfer.connector,
            weight_bytes_per_stage=[r.weight_nbytes for r in readies],
            stage_cpus=[list(a.cpus) for a in stages.stage_args],
            startup_s=round(time.monotonic() - t0, 2),
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain_and_stop()))
        if config.server.http_port:
            http = await start_http(ns.config, config, router.address, stages.addresses.run_id)
            print(f"asyncpp http: OpenAI API on {http_url(config)}/v1", file=sys.stderr, flush=True)
        # Only now: whoever reads this line may signal us at once.
        where = f"; {stages.pp_size} stages as Ray actors on {len({p.node_id for p in stages.procs})} node(s)" if (
            config.parallel.backend == "ray") else ""  # fmt: skip
        print(f"asyncpp ready: clients connect to {router.address} ({plan.summary()}{where})", file=sys.stderr, flush=True)
        log.debug("gc_heap_frozen", num_objects=freeze_startup_heap())
        with profiled("engine"):
            serving = asyncio.create_task(server.serve())
            if ns.prompt is not None:
                ok = await one_shot(router.address, ns.prompt, ns.max_tokens, config.server.client_secret)
                if not server.is_dead:
                    await server.drain_and_stop()
                code = await serving
                return code if ok else 1
            return await serving
    finally:
        if http is not None:
            await stop_http(http)
        router.close()
        await stages.shutdown()
        for segment in shared_kv:  # after the stages, which map them
            segment.close()
        if kv_connector is not None:
            kv_connector.close()  # after the stages: it removes what a killed stage left behind
        log.info("engine_stopped")


def launch_namespace(config_path: str, log_format: str = "console", log_level: str = "info",
                     log_file: str | None = None) -> argparse.Namespace:  # fmt: skip
    """What `run` reads of the command line, for a caller with a config of its own (`asyncpp serve`)."""
    return parse_args(["--config", config_path, "--log-format", log_format, "--log-level", log_level]
                      + (["--log-file", log_file] if log_file else []))  # fmt: skip


def serve(config: EngineConfig, ns: argparse.Namespace) -> int:
    """Log as `ns` says and serve `config` until stopped: the exit code (2: a bad setting found at start-up)."""
    configure_logging(ns.log_format, ns.log_level, ns.log_file)
    if config.parallel.dp_size > 1:  # data parallelism: replicas of this engine behind a router
        from asyncpp.dp.deploy import main as dp_main

        return dp_main(config, ns)
    try:
        return uvloop.run(run(config, ns))
    except ConfigError as e:  # found at start-up (a KV connector name, an unwritable store, its handshakes)
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.log_level is None:  # a one-shot answer keeps the terminal clean; a log file gets the events
        ns.log_level = "warning" if ns.prompt is not None and not ns.log_file else "info"
    configure_logging(ns.log_format, ns.log_level, ns.log_file)
    if is_disagg_config(ns.config):  # prefill/decode disaggregation: two engines behind a router
        from asyncpp.disagg.deploy import main as disagg_main

        return disagg_main(ns)
    try:
        config = with_http_overrides(load_config(ns.config), ns.http_host, ns.http_port, ns.api_key)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(config, ns)


if __name__ == "__main__":
    sys.exit(main())
