"""A pipeline stage process: load its slice, ack ready, then run plans until shutdown.

Start-up: `StageReady` once the slice is loaded; after `StageStart`, the
runner (and its KV connector, caches registered) is built and the stage
sends `StageHandshake` with its connector's transfer endpoint (None without
one) before it takes any plan, so on the outputs channel every handshake
precedes that stage's first `StageOutput`.

Per step: take the plan (engine -> every stage, in step order); a stage
after the first prepares the step (`ModelRunner.prepare_step`: states, KV
connector binding, inputs) and only then waits for the activation notice from
the previous stage (same order), so the wait hides the preparation; run
`execute_model`; a non-last stage writes its activations into the next
stage's ring slot, sends the notice and reports
`ModelRunnerOutput.with_kv_conn_output_only(...)`; the last stage runs
`sample_tokens`. Every stage reports a `StageOutput` for every step, also a
failed one (with `error` set), so the engine always completes the step.

Async scheduling (pp_size > 1): the last stage also sends the first stage
the tokens each step sampled (`SampledTokens`), and the first stage, before
running a plan with placeholders, waits for those of `plan.after_step_id`:
the next step of a cohort starts one hop after the last stage samples,
without a round trip through the engine (`asyncpp.runtime.token_handoff`;
on GPUs the tokens stay on the devices: `asyncpp.transport.token_ring`).

Async output (one stage, `scheduler.async_output`): a step whose tokens may
stay on the device is held (`_HeldStep`) rather than reported: the stage
takes the next plan, fills its placeholders on the device and enqueues it,
and only then reports the held step, whose tokens have reached the host
meanwhile. With no next plan, the held step is reported as soon as its
tokens are in. The engine's turnaround and the stage's input preparation
and launch then overlap the device's work on the step before.

A plan with `num_threads` > 0 runs with that many torch threads (the engine
lends a lone cohort the idle stages' cores); the next plan with 0 gets the
stage's own `num_threads` back. `torch.set_num_threads` is called only on a change.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass

import torch

from asyncpp.config import SpeculativeConfig
from asyncpp.core.plan import StepPlan
from asyncpp.device import indexed_device, is_cuda
from asyncpp.kv_transfer.base import ConnectorContext
from asyncpp.kv_transfer.registry import create_worker_connector
from asyncpp.logging import configure_logging, get_logger, is_debug_enabled
from asyncpp.model.intermediate import INTERMEDIATE_KEYS
from asyncpp.profiling import profiled
from asyncpp.runtime.addresses import RunAddresses
from asyncpp.runtime.fault_hooks import exit_if_faulted
from asyncpp.runtime.gc_heap import freeze_startup_heap
from asyncpp.runtime.parent_death import die_with_parent
from asyncpp.runtime.token_handoff import TokenInbox, TokenOutbox
from asyncpp.step_phases import step_phases
from asyncpp.transport import ActivationNotice, RingSpec, get_transport
from asyncpp.transport.token_ring import TokenRingReader, TokenRingWriter
from asyncpp.weights import read_arch
from asyncpp.wire.queues import PullQueue, PushQueue
from asyncpp.wire.stage_msgs import (
    Shutdown,
    StageHandshake,
    StageOutput,
    StageReady,
    StageStart,
)
from asyncpp.worker.async_output import PendingOutput
from asyncpp.worker.model_runner import ModelRunner
from asyncpp.worker.outputs import ModelRunnerOutput
from asyncpp.worker.shared_kv import SharedKVSegment
from asyncpp.worker.stage import (
    build_model_slice,
    build_runner,
    load_grammars,
    stage_num_blocks,
    torch_dtype,
)


@dataclass(frozen=True)
class StageArgs:
    pp_rank: int
    pp_size: int
    start_layer: int  # the layers held: loaded, with a KV cache (shared ones included)
    end_layer: int
    model_source: str
    model_path: str | None
    dtype: str  # resolved (`ComputePlan.dtype`), never "auto"
    device: str
    linear_kernel: str
    fma_min_rows: tuple[int | None, int | None]  # the plan's: (float weights, GGUF blocks)
    num_threads: int
    block_size: int
    kv_cache_memory_mb: int
    max_num_batched_tokens: int
    num_ring_slots: int
    transport: str
    addresses: RunAddresses
    peer_device: str = "cpu"  # the previous stage's device (it writes into this stage's ring)
    graph_sizes: tuple[int, ...] = ()  # decode batch sizes captured as CUDA graphs (none on CPU)
    max_model_len: int = 0
    isa: str | None = None  # the CPU kernels' ISA level (None: the CPU's best); StageGroup caps torch's too
    weight_format: str = "float"  # "float" | "native" (the file's blocks, expanded in the kernels), resolved
    kv_connector: ConnectorContext | None = None  # None: no KV connector
    kv_connector_module: str = ""  # imported before the connector is looked up (out-of-tree connectors)
    nice: int = 0  # added to the stage's niceness: the engine's per-step bursts preempt it at once
    cpus: tuple[int, ...] = ()  # CPU stages: thread i is bound to cpus[i] (`cpu_affinity`); () = unbound
    async_scheduling: bool = False  # pass sampled tokens from the last stage to the first
    # One stage: report a step once the next is enqueued, its tokens on the host by then
    # (`asyncpp.worker.async_output`; `EngineConfig.uses_async_output`).
    async_output: bool = False
    log_format: str = "console"
    log_level: str = "info"
    log_file: str | None = None
    run_layers: tuple[int, int] | None = None  # the layers a plan without `layer_bounds` runs; None: all held
    speculative: SpeculativeConfig | None = None  # speculative decoding: the last stage runs the proposer
    # The first stage's token ring (`asyncpp.transport.token_ring`, its handles still empty); None:
    # sampled tokens go the host path.
    token_ring: RingSpec | None = None

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclass
class StageInputs:
    """The queues a stage receives on besides the plans. A local stage binds them itself; a Ray actor
    binds them on port 0 before the run's addresses exist and reports the ports the OS chose."""

    acts_in: PullQueue | None = None  # every stage but the first: the previous stage's activation notices
    tokens_in: PullQueue | None = None  # the first stage, tokens passed (async scheduling, pp > 1)

    @staticmethod
    def bind(args: StageArgs, activations_addr: str, sampled_addr: str, token: str | None) -> StageInputs:
        takes_tokens = args.is_first and args.async_scheduling and args.pp_size > 1
        return StageInputs(
            PullQueue(activations_addr, bind=True, token=token) if not args.is_first else None,
            PullQueue(sampled_addr, bind=True, token=token) if takes_tokens else None,
        )


def stage_main(args: StageArgs, inputs: StageInputs | None = None) -> None:
    """Entry point of a spawned stage process; `inputs`: its receiving queues if already bound."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    _die_with_launcher()
    exit_if_faulted(args.pp_rank)  # a test's crash loop
    configure_logging(args.log_format, args.log_level, args.log_file)
    torch.set_num_threads(args.num_threads)
    if is_cuda(args.device):
        torch.cuda.set_device(indexed_device(args.device))
    if args.nice:
        os.nice(args.nice)
    log = get_logger(role="stage", pp_rank=args.pp_rank)
    stage = Stage(args, log, inputs)
    try:
        with profiled(f"stage{args.pp_rank}"):
            stage.serve()
    finally:
        stage.close()
    log.info("stage_stopped")


def _die_with_launcher() -> None:
    """Have the kernel kill this stage when the launcher dies without reaping it (SIGKILL, OOM):
    otherwise an orphaned stage blocks forever on a socket whose peer is gone, holding its
    shared-memory ring."""
    parent = multiprocessing.parent_process()
    die_with_parent(signal.SIGKILL, parent.pid if parent is not None else None)


class StepThreads:
    """torch's thread count per step: the plan's lent count, else the stage's own."""

    def __init__(self, num_threads: int, set_num_threads=torch.set_num_threads) -> None:
        self.num_threads = num_threads  # the stage's own (`parallel.num_threads`)
        self.current = num_threads  # `stage_main` sets it before any step
        self._set_num_threads = set_num_threads

    def apply(self, plan_num_threads: int) -> None:
        wanted = plan_num_threads or self.num_threads
        if wanted != self.current:  # not free: torch reconfigures its pools
            self._set_num_threads(wanted)
            self.current = wanted


class Stage:
    def __init__(self, args: StageArgs, log, inputs: StageInputs | None = None) -> None:
        self.args = args
        self.log = log
        self.is_debug = is_debug_enabled(log)
        addrs, token = args.addresses, args.addresses.token  # token: control channels across hosts
        self.plans = PullQueue(addrs.plan(args.pp_rank), token=token)
        self.outputs = PushQueue(addrs.stage_outputs, token=token)
        if inputs is None:  # a local stage: its ipc:// paths are private to the run directory
            inputs = StageInputs.bind(args, addrs.activations(args.pp_rank), addrs.sampled_tokens, token)
        self.acts_in = inputs.acts_in
        self.tokens_in = TokenInbox(inputs.tokens_in) if inputs.tokens_in is not None else None
        self.acts_out = PushQueue(addrs.activations(args.pp_rank + 1), token=token) if not args.is_last else None
        passes_tokens = args.async_scheduling and args.pp_size > 1
        self.tokens_out = TokenOutbox(PushQueue(addrs.sampled_tokens, token=token)) if passes_tokens and args.is_last else None
        self.threads = StepThreads(args.num_threads)
        self.receiver = None
        self.sender = None
        self.shared_kv: list[SharedKVSegment] = []
        self.runner: ModelRunner | None = None
        self.phases = step_phases(args.device)  # off unless ASYNCPP_STEP_PHASES=1
        self.held: _HeldStep | None = None  # async output: the step reported after the next is enqueued

    def serve(self) -> None:
        start = self._start_up()
        self._build_runner(start)
        self.outputs.put(StageHandshake(self.args.pp_rank, 0, self.runner.kv_connector.get_handshake_metadata()))
        self.runner.phases = phases = self.phases
        self.log.debug("gc_heap_frozen", num_objects=freeze_startup_heap())
        while True:
            msg = self._next_plan()
            phases.mark("wait_plan")  # idle until the engine's plan, and reading it
            if isinstance(msg, Shutdown):
                self._report_held()
                return
            phases.start_step()
            output = self._run_step(msg)
            self._report_held()  # the step before, now that this one is enqueued
            if isinstance(output, _HeldStep):
                self.held = output
            else:
                self.outputs.put(output)
            phases.mark("send_output")

    def _next_plan(self):
        """The engine's next message. While a step is held, it is reported as soon as its tokens are
        on the host, unless a plan comes first (which is then enqueued before it is reported)."""
        while self.held is not None and not self.plans.has_message():
            if self.held.is_ready():
                self.phases.mark("wait_plan")
                self._report_held()
        return self.plans.get()

    def _report_held(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self.outputs.put(held.report())
            self.phases.mark("report_held")  # the tokens' wait and list, the output's encoding

    def _start_up(self) -> StageStart:
        a = self.args
        t0 = time.time()
        arch = read_arch(a.model_source, a.model_path)
        dtype = torch_dtype(a.dtype)
        self.model = build_model_slice(
            a.model_source, a.model_path, arch, a.start_layer, a.end_layer, dtype, a.device, a.linear_kernel,
            isa=a.isa, weight_format=a.weight_format, fma_min_rows=a.fma_min_rows,
        )  # fmt: skip
        recv_spec = None
        if not a.is_first:
            recv_spec = RingSpec(
                transport=a.transport,
                name=a.addresses.ring_name(a.pp_rank),
                keys=list(INTERMEDIATE_KEYS),
                num_slots=a.num_ring_slots,
                max_num_tokens=a.max_num_batched_tokens,
                hidden_size=arch.hidden_size,
                dtype=a.dtype,
                device=a.device,
                peer_device=a.peer_device,
            )
            self.receiver = get_transport(a.transport).create_receiver(recv_spec)
            recv_spec = self.receiver.spec  # with the transport's handles
        token_spec = None
        if a.token_ring is not None and self.tokens_in is not None:
            self.tokens_in.reader = TokenRingReader(a.token_ring)
            token_spec = self.tokens_in.reader.spec
        num_blocks = stage_num_blocks(arch, a.end_layer - a.start_layer, a.kv_cache_memory_mb, a.block_size, dtype)
        load_time_s = time.time() - t0
        weight_nbytes = self.model.weight_nbytes()
        self.outputs.put(
            StageReady(
                a.pp_rank, os.getpid(), a.start_layer, a.end_layer, num_blocks, recv_spec, load_time_s, weight_nbytes,
                token_spec,
            )
        )
        self.log.info(
            "stage_ready", num_kv_blocks=num_blocks, load_time_s=round(load_time_s, 3), weight_nbytes=weight_nbytes,
            isa=a.isa, dtype=a.dtype, weight_format=a.weight_format,
        )  # fmt: skip
        start = self.plans.get()
        if isinstance(start, Shutdown):
            raise SystemExit(0)
        if not isinstance(start, StageStart):
            raise RuntimeError(f"expected StageStart, got {type(start).__name__}")
        return start

    def _build_runner(self, start: StageStart) -> None:
        a = self.args
        shared_kv = {}
        for spec in start.shared_kv:
            if a.start_layer <= spec.first_layer < a.end_layer:
                self.shared_kv.append(SharedKVSegment.attach(spec))
                shared_kv.update(self.shared_kv[-1].caches())
        self.runner = build_runner(
            self.model,
            num_blocks=start.num_kv_blocks,
            block_size=a.block_size,
            max_num_batched_tokens=a.max_num_batched_tokens,
            dtype=torch_dtype(a.dtype),
            device=a.device,
            kv_connector=create_worker_connector(a.kv_connector, a.pp_rank, a.kv_connector_module),
            graph_sizes=a.graph_sizes,
            max_model_len=a.max_model_len,
            isa=a.isa,
            pp_rank=a.pp_rank,
            layer_range=a.run_layers,
            shared_kv=shared_kv,
            speculative=a.speculative,
            grammars=load_grammars(a.model_source, a.model_path, self.model.arch.vocab_size),
        )
        # The graphs read the ring's slots in place: the previous stage's write is the only copy.
        self.runner.build_graphs(self.receiver.slots() if self.receiver is not None else None)
        if start.send_ring is not None:
            self.sender = get_transport(start.send_ring.transport).attach_sender(start.send_ring)
        if start.token_ring is not None and self.tokens_out is not None:
            self.tokens_out.writer = TokenRingWriter(start.token_ring)
            self.tokens_out.attach(self.runner)

    def _run_step(self, plan: StepPlan) -> StageOutput | _HeldStep:
        handoff_us, error = 0.0, None
        output = ModelRunnerOutput()
        if self.tokens_in is not None:
            self.tokens_in.take(self.runner, plan)
            self.phases.mark("wait_tokens")
        t0 = t_written = time.time()  # waiting for sampled tokens is not busy time
        # A plan with no tokens moves no activations (only the KV connector is polled).
        moves_activations = not plan.is_empty
        is_handed_off = is_connector_done = False
        read_slot = None  # the ring slot this step reads, released once its forward is enqueued
        prepare_s = 0.0  # the step's preparation while its activations were on their way: busy time too
        try:
            self.threads.apply(plan.num_threads)
            intermediate = None
            if self.acts_in is not None and moves_activations:
                try:
                    self.runner.prepare_step(plan)  # before the wait, which hides it
                finally:  # the notice is taken even when preparing failed: the next step must not read it
                    prepare_s = time.time() - t0
                    notice = self.acts_in.get()
                    self.phases.mark("wait_activations")
                    t0 = t_written = time.time()  # waiting for the previous stage is not busy time
                if notice.step_id != plan.step_id:
                    raise RuntimeError(f"activation notice for step {notice.step_id} while running step {plan.step_id}")
                intermediate = self.receiver.view(notice)
                read_slot = notice.slot
            try:
                result = self.runner.execute_model(plan, intermediate)
            finally:
                if read_slot is not None:
                    self.receiver.release(read_slot)
            if self.args.async_output:
                pending = self.runner.sample_tokens_async()
                if pending.is_deferred:
                    return _HeldStep(self, plan, pending, t0)
                output = pending.get()
                is_connector_done = True
            elif self.args.is_last:
                output = self.runner.sample_tokens()
                is_connector_done = True
                if self.tokens_out is not None:
                    self.tokens_out.send(plan.step_id, output)
                    self.phases.mark("send_tokens")
            else:
                if moves_activations:
                    t_handoff = time.perf_counter()
                    notice = self.sender.write(plan.step_id, result)
                    handoff_us = (time.perf_counter() - t_handoff) * 1e6
                    # The slice ends when the activations are in place; the notice releases the next stage.
                    t_written = time.time()
                    self.acts_out.put(notice)
                    self.phases.mark("handoff")
                is_handed_off = True
                output = self.runner.finish_step()
                is_connector_done = True
        except Exception as e:  # noqa: BLE001 - reported to the engine, which fails the step's requests
            error = f"stage {self.args.pp_rank}: {type(e).__name__}: {e}"
            self.log.error("step_failed", step_id=plan.step_id, error=error)
            if self.runner is not None and not is_connector_done:
                output = self._abort_step(plan, output)
            if self.acts_out is not None and moves_activations and not is_handed_off:
                # Let the next stage fail this step too instead of waiting forever.
                self.acts_out.put(ActivationNotice(plan.step_id, 0, 0, []))
            if self.tokens_out is not None:  # nor may the first stage wait forever
                self.tokens_out.send_failed(plan.step_id)
        t1 = time.time() if self.args.is_last or error is not None else t_written
        return self._stage_output(plan, output, t0, t1, handoff_us, error, prepare_s)

    def _stage_output(
        self, plan: StepPlan, output: ModelRunnerOutput, t0: float, t1: float, handoff_us: float, error: str | None,
        prepare_s: float = 0.0,
    ) -> StageOutput:
        """The step's report; its busy time is the slice t0..t1 plus `prepare_s`, the preparation done
        before the slice (while the activations were on their way), which the stage spent on it too."""
        busy_s = t1 - t0 + prepare_s
        if self.is_debug:  # this core is the pipeline's: spend nothing on an event nobody keeps
            self.log.debug(
                "stage_done",
                step_id=plan.step_id,
                num_tokens=plan.num_tokens,
                num_reqs=plan.num_reqs,
                start_us=int(t0 * 1e6),
                end_us=int(t1 * 1e6),
                busy_ms=round(busy_s * 1e3, 3),
                prepare_ms=round(prepare_s * 1e3, 3),
                handoff_us=round(handoff_us, 1),
                num_threads=self.threads.current,
            )
        return StageOutput(plan.step_id, self.args.pp_rank, output, busy_s, handoff_us, error)

    def _abort_step(self, plan: StepPlan, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Close a failed step: the connector still runs its transfers and reports."""
        try:
            return self.runner.abort_step(plan)
        except Exception as e:  # noqa: BLE001 - the step's error is reported already
            self.log.error("kv_connector_failed", step_id=plan.step_id, error=repr(e))
            return output

    def close(self) -> None:
        if self.phases.num_steps:  # ASYNCPP_STEP_PHASES=1
            self.log.info("step_phases", **self.phases.summary())
        if self.tokens_in is not None:  # which way the sampled tokens came
            self.log.info("sampled_tokens_taken", on_device=self.tokens_in.num_on_device, on_host=self.tokens_in.num_on_host)
        if self.runner is not None:
            if self.runner.graphs is not None:  # how often each graph size served a step
                self.log.info("cuda_graph_runs", runs={str(size): n for size, n in self.runner.graphs.num_runs.items()})
            self.runner.kv_connector.close()
        for closable in (self.sender, self.receiver, *self.shared_kv):
            if closable is not None:
                closable.close()
        for q in (self.plans, self.outputs, self.acts_in, self.acts_out, self.tokens_in, self.tokens_out):
            if q is not None:
                q.close()


class _HeldStep:
    """A step whose sampled tokens are still on their way to the host (async output): reported once
    the stage has enqueued the next step, or as soon as they are in when no plan comes."""

    def __init__(self, stage: Stage, plan: StepPlan, pending: PendingOutput, t0: float) -> None:
        self.stage, self.plan, self.pending, self.t0 = stage, plan, pending, t0

    def is_ready(self) -> bool:
        return self.pending.is_ready()

    def report(self) -> StageOutput:
        error, output = None, ModelRunnerOutput()
        try:
            output = self.pending.get()
        except Exception as e:  # noqa: BLE001 - reported to the engine, which fails the step's requests
            error = f"stage {self.stage.args.pp_rank}: {type(e).__name__}: {e}"
            self.stage.log.error("step_failed", step_id=self.plan.step_id, error=error)
        return self.stage._stage_output(self.plan, output, self.t0, time.time(), 0.0, error)
