"""`Engine`: the in-process engine. schedule -> execute -> update -> detokenize.

`add_request` validates and tokenizes (touching no state on error), `step`
runs one scheduled step and returns the streamed deltas, `abort` finishes a
request and frees its blocks, `generate` is the synchronous convenience,
`stats` the counters, the compute plan (ISA level, resolved dtype, weight
format: `compute_plan.py`) and each stage's resident weight bytes.
The pipeline runtime wraps the same scheduler and processors around stage
processes instead of the in-process executor.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from asyncpp.config import EngineConfig
from asyncpp.core.request import Request, RequestStatus
from asyncpp.core.scheduler import Scheduler
from asyncpp.device import check_devices
from asyncpp.engine.compute_plan import ComputePlan, compute_stats, resolve_compute_plan
from asyncpp.engine.startup import (
    EngineCapacity,
    draft_policy,
    kv_connector_context,
    resolve_capacity,
    set_stage_handshakes,
)
from asyncpp.engine.executor import InProcessExecutor
from asyncpp.engine.input_processor import InputProcessor, Prompt
from asyncpp.engine.layer_balance import LayerBalancer
from asyncpp.engine.output_processor import OutputProcessor
from asyncpp.engine.outputs import Completion, RequestOutput
from asyncpp.errors import InvalidRequestError
from asyncpp.kernels.isa import torch_isa_env
from asyncpp.kv.block_manager import BlockManager
from asyncpp.kv_transfer.base import KVConnectorScheduler
from asyncpp.kv_transfer.handshake import aggregate_handshakes
from asyncpp.kv_transfer.metadata import KVConnectorOutput, KVTransferStats
from asyncpp.kv_transfer.registry import create_scheduler_connector, create_worker_connector
from asyncpp.logging import get_logger
from asyncpp.model.arch import ModelArch
from asyncpp.samples import LatestPerKey
from asyncpp.sampling.params import SamplingParams
from asyncpp.tokenizer import load_tokenizer
from asyncpp.weights import read_arch
from asyncpp.worker.outputs import ModelRunnerOutput
from asyncpp.worker.shared_kv import allocate_shared_kv
from asyncpp.worker.stage import (
    build_model_slice,
    build_runner,
    step_graph_sizes,
    torch_dtype,
)

_RUN_IDS = itertools.count()


class EngineCore:
    """Scheduler + request state + detokenization; no model. Shared by both runtimes.

    With a KV connector, its scheduler side lives here, and every step's
    stage outputs are merged (`Scheduler.merge_kv_outputs`) before the
    scheduler applies them.
    """

    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        tokenizer: Any,
        capacity: EngineCapacity,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.arch = arch
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.block_manager = BlockManager(
            capacity.num_blocks, capacity.block_size, enable_prefix_caching=config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=capacity.max_model_len,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
            async_scheduling=config.scheduler.async_scheduling,
            connector=kv_connector,
            draft_policy=draft_policy(config.speculative),
        )
        self.kv_connector = kv_connector
        self.kv_transfer_stats = KVTransferStats()
        self.kv_handover_s = LatestPerKey()  # remote KV ready -> in place on every stage, per request
        self.input_processor = InputProcessor(tokenizer, arch.vocab_size, capacity.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self.log = get_logger(role="engine")

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Validate and queue a request; `kv_transfer_params`: for the KV connector (checked by it)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request_id in self.output_processor or self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError("request_id", f"duplicate request id {request_id!r}")
        prompt_token_ids = self.input_processor.process(prompt, params)
        output_token_ids: list[int] = []  # generated by a remote engine, streamed by it already
        awaits_remote_tokens = False  # ... or to come, once that engine has computed the prompt
        if kv_transfer_params is not None:
            if self.kv_connector is None:
                raise InvalidRequestError("kv_transfer_params", "this engine has no KV connector")
            try:
                self.kv_connector.validate_kv_transfer_params(kv_transfer_params, prompt_token_ids)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError("kv_transfer_params", str(e)) from e
            output_token_ids = self.kv_connector.remote_output_token_ids(kv_transfer_params)
            awaits_remote_tokens = self.kv_connector.awaits_remote_prefill(kv_transfer_params)
            if len(output_token_ids) + awaits_remote_tokens >= params.max_tokens:
                raise InvalidRequestError(
                    "max_tokens",
                    f"max_tokens {params.max_tokens} leaves nothing to generate after the "
                    f"{len(output_token_ids)} tokens the remote engine generated",
                )
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.tokenizer.eos_token_id,
            output_token_ids=list(output_token_ids),
            kv_transfer_params=kv_transfer_params,
            awaits_remote_tokens=awaits_remote_tokens,
        )
        try:
            self.output_processor.add_request(request)
        except ValueError as e:
            raise InvalidRequestError("kv_transfer_params", str(e)) from e
        if kv_transfer_params is not None:
            self.kv_connector.claim_kv_transfer_params(kv_transfer_params)  # used once (pd)
        self.scheduler.add_request(request)
        self.log.info("request_received", request_id=request_id, num_prompt_tokens=len(prompt_token_ids))
        return request_id

    def add_remote_prefill(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """The remote engine's params for a request that awaited its prefill: its first tokens (which
        that engine streamed) go in, and it is computed once its KV is loaded. `InvalidRequestError`
        if they are not this request's (the caller fails the request: nothing else changes)."""
        request = self.scheduler.get_request(request_id)
        if request is None or request.is_finished or request_id not in self.output_processor:
            raise InvalidRequestError("request_id", f"no unfinished request {request_id!r}")
        if not request.awaits_remote_tokens or self.kv_connector is None:
            raise InvalidRequestError("kv_transfer_params", f"request {request_id!r} awaits no remote prefill")
        try:
            token_ids = self.kv_connector.accept_remote_prefill(request, kv_transfer_params)
            self.output_processor.add_remote_tokens(request_id, token_ids)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError("kv_transfer_params", str(e)) from e
        if request.num_output_tokens + len(token_ids) >= request.sampling_params.max_tokens:
            raise InvalidRequestError("max_tokens", "leaves nothing to generate after the remote engine's tokens")
        self.scheduler.add_remote_tokens(request_id, token_ids)

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED, error: str | None = None
    ) -> RequestOutput | None:
        """Finish a request now (client abort, or `FINISHED_ERROR` with `error`) and free its blocks."""
        self.scheduler.finish_requests([request_id], status)
        out = self.output_processor.abort(request_id, status.finish_reason, error)
        if out is not None:
            event = "request_aborted" if status is RequestStatus.FINISHED_ABORTED else "request_failed"
            self.log.info(event, request_id=request_id, error=error)
        return out

    def merge_kv_outputs(self, outputs: list[ModelRunnerOutput]) -> KVConnectorOutput | None:
        """Every stage's connector report of one step, merged (None without a connector)."""
        if self.kv_connector is None:
            return None
        merged = self.scheduler.merge_kv_outputs([o.kv_connector_output for o in outputs])
        stats = merged.stats
        if stats.handover_s:  # one sample per request (the latest stage's), not a running sum
            for request_id, seconds in stats.handover_s.items():
                self.kv_handover_s.put(request_id, seconds)
            stats = dataclasses.replace(stats, handover_s={})
        self.kv_transfer_stats = self.kv_transfer_stats + stats
        return merged

    def process_failed_step(self, plan: Any, outputs: list[ModelRunnerOutput]) -> list[str]:
        """A step some stage failed: roll its requests back and keep the transfer reports. Returns the
        requests the caller must fail: the step's, and any other that read the KV it left invalid."""
        self.scheduler.update_from_output(plan, {}, self.merge_kv_outputs(outputs))
        return self.scheduler.discard_failed_step(plan)

    def take_failed_requests(self) -> list[tuple[str, str]]:
        """(request, why) the scheduler found failed while applying outputs (a KV load within a
        plan that failed): the caller fails each with that error."""
        return self.scheduler.take_failed_requests()

    def process_output(self, plan: Any, outputs: list[ModelRunnerOutput]) -> list[RequestOutput]:
        """One step's outputs, one per stage (the last stage's holds the sampled tokens)."""
        output = outputs[-1]
        logprobs = dict(zip(output.req_ids, output.logprobs, strict=True))
        updates = self.scheduler.update_from_output(
            plan, output.sampled_by_request(), self.merge_kv_outputs(outputs), output.drafts_by_request()
        )
        results = []
        for update in updates:
            token_logprobs = logprobs.get(update.request_id)
            if token_logprobs is not None:  # several tokens in a step: none past a stop
                token_logprobs = token_logprobs[: len(update.new_token_ids)]
            out = self.output_processor.process(
                update.request_id,
                update.new_token_ids,
                update.finish_reason,
                update.stop_reason,
                token_logprobs,
            )
            if out is None:
                continue
            if out.finished and update.finish_reason is None:  # a stop string ended it
                for request in self.scheduler.finish_requests([update.request_id], RequestStatus.FINISHED_STOPPED):
                    out = dataclasses.replace(out, kv_transfer_params=request.finished_kv_transfer_params)
            elif out.finish_reason != update.finish_reason and out.kv_transfer_params is not None:
                # a stop string in the token the scheduler finished it at (and handed out params for)
                out = self._withdraw_handout(out)
            if out.finished:
                self.log.info("request_finished", request_id=out.request_id, finish_reason=out.finish_reason)
            results.append(out)
        return results


    def _withdraw_handout(self, out: RequestOutput) -> RequestOutput:
        """The token a prefill hands out (the scheduler finished it at max_tokens, params made) ends
        at a stop string: the request is over here, as on one engine. No params leave the engine,
        and the blocks held for them are freed now."""
        self.scheduler.withdraw_send(out.request_id)
        self.log.info("kv_handout_withdrawn", request_id=out.request_id, stop_reason=out.stop_reason)
        return dataclasses.replace(out, kv_transfer_params=None)

    def kv_stats(self) -> dict[str, Any]:
        """KV connector counters for `stats()`: transfers summed over stages, the connector's own."""
        if self.kv_connector is None:
            return {}
        t = self.kv_transfer_stats
        return {
            "kv_connector": self.config.kv_transfer.connector,
            "kv_blocks_loaded": t.num_blocks_loaded,
            "kv_blocks_saved": t.num_blocks_saved,
            "kv_bytes_loaded": t.num_bytes_loaded,
            "kv_bytes_saved": t.num_bytes_saved,
            "kv_load_time_s": t.load_time_s,
            "kv_save_time_s": t.save_time_s,
            "num_held_for_transfer": self.scheduler.num_held_for_transfer,
            "num_timed_out_transfers": self.scheduler.num_timed_out_transfers,
            # Blocks a read the transport could not stop may still write: out of the free pool until it ends.
            "kv_num_quarantined_blocks": self.scheduler.num_quarantined_blocks,
            "kv_num_handovers": self.kv_handover_s.count,
            **self.kv_handover_s.summary("kv_handover_s"),
            **self.kv_connector.stats(),
        }


class Engine(EngineCore):
    """The in-process engine: every stage runs in this process."""

    # While only KV transfers are pending, poll the stages this often (they move the bytes on threads).
    POLL_INTERVAL_S = 0.001

    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(config.parallel.num_threads)
        devices = check_devices(config)
        plan = resolve_compute_plan(config.model, devices)  # a bad cpu_isa / dtype / weight_format: here
        arch = read_arch(config.model.source, config.model.path_or_none)
        tokenizer = load_tokenizer(config.model.source, config.model.path_or_none, arch.vocab_size)
        capacity = resolve_capacity(config, arch, plan.dtype)
        run_id = f"{os.getpid()}-{next(_RUN_IDS)}"
        kv_ctx = kv_connector_context(config, arch, capacity.layer_ranges, run_id, plan.dtype)
        kv_module = config.kv_transfer.module
        super().__init__(config, arch, tokenizer, capacity, create_scheduler_connector(kv_ctx, kv_module))
        self.compute_plan = plan
        self._log_compute_plan(plan)
        if config.shift_layers_off_reason:
            self.log.warning("shift_layers_off", shift_layers=config.parallel.shift_layers, reason=config.shift_layers_off_reason)
        dtype = torch_dtype(plan.dtype)
        runners = []
        self.weight_bytes_per_stage: list[int] = []  # resident weight bytes of each stage's slice
        # In process the windows' caches are plain tensors: their segment names go unused.
        shared_kv = allocate_shared_kv(capacity.shared_kv_specs(arch, plan.dtype, [""] * len(capacity.shift_windows)))
        self.balancer = LayerBalancer(arch, capacity.layer_ranges, capacity.shift_windows) if capacity.is_shifting else None
        for rank, (start, end) in enumerate(capacity.held_ranges):
            device = devices[rank]
            model = build_model_slice(
                config.model.source,
                config.model.path_or_none,
                arch,
                start,
                end,
                dtype,
                device,
                config.model.linear_kernel,
                isa=plan.isa,
                weight_format=plan.weight_format,
            )
            self.weight_bytes_per_stage.append(model.weight_nbytes())
            runner = build_runner(
                model,
                num_blocks=capacity.num_blocks,
                block_size=capacity.block_size,
                max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                dtype=dtype,
                device=device,
                kv_connector=create_worker_connector(kv_ctx, rank, kv_module),
                graph_sizes=step_graph_sizes(config, device),
                max_model_len=capacity.max_model_len,
                isa=plan.isa,
                pp_rank=rank,
                layer_range=capacity.layer_ranges[rank],
                shared_kv={i: kv for i, kv in shared_kv.items() if start <= i < end},
                speculative=config.speculative if config.speculative.is_enabled else None,
            )
            runner.build_graphs()
            runners.append(runner)
        self.executor = InProcessExecutor(runners)
        try:
            handshakes = aggregate_handshakes(
                (rank, 0, runner.kv_connector.get_handshake_metadata()) for rank, runner in enumerate(runners)
            )
            if self.kv_connector is not None:
                set_stage_handshakes(self.kv_connector, handshakes)
        except Exception:
            self.close()  # the connectors' threads and stores
            raise
        self.log.info(
            "engine_ready", num_blocks=capacity.num_blocks, layer_ranges=capacity.layer_ranges,
            weight_bytes_per_stage=self.weight_bytes_per_stage,
        )  # fmt: skip

    def _log_compute_plan(self, plan: ComputePlan) -> None:
        self.log.info("compute_plan", **plan.describe())
        # torch is imported already: its own kernels run at the level of this process's environment.
        uncapped = {k: v for k, v in torch_isa_env(plan.isa).items() if os.environ.get(k) != v}
        if uncapped:
            self.log.warning(
                "torch_isa_not_capped", isa=plan.isa, best_isa=plan.best_isa,
                hint=f"start this process with {' '.join(f'{k}={v}' for k, v in uncapped.items())}",
            )  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Like `client.stats()` of a launched engine: scheduler counts, KV blocks, the compute plan
        and each stage's resident weight bytes."""
        bm = self.block_manager
        return {
            **dataclasses.asdict(self.scheduler.stats()),
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            **compute_stats(self.compute_plan, self.weight_bytes_per_stage),
            **self.kv_stats(),
            **({"layer_balance": self.balancer.stats()} if self.balancer is not None else {}),
        }

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_transfers(self) -> bool:
        return self.scheduler.has_pending_transfers()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan is None and self.has_pending_transfers():
            # Nothing to compute, but KV transfers to start or to poll.
            if self.kv_connector is None or not self.kv_connector.has_unsent_metadata():
                time.sleep(self.POLL_INTERVAL_S)
            plan = self.scheduler.schedule(allow_empty=True)
        if plan is None:
            return []
        t0 = time.perf_counter()
        if self.balancer is not None and not plan.is_empty:
            plan = dataclasses.replace(plan, layer_bounds=self.balancer.bounds(plan))
        executed = self.executor.execute(plan)
        if executed.errors:
            return self._fail_step(plan, executed.outputs, executed.errors)
        if self.balancer is not None:
            self.balancer.observe(plan, self.executor.busy_s)
        if self.scheduler.draft_policy is not None:
            self.scheduler.draft_policy.observe_step(plan.num_tokens, sum(self.executor.busy_s))
        results = self.process_output(plan, executed.outputs)
        if failed := self.take_failed_requests():  # a KV load within the step failed: what they
            failed_ids = {request_id for request_id, _ in failed}  # sampled came from missing KV
            results = [out for out in results if out.request_id not in failed_ids]
            for request_id, why in failed:
                out = self.abort(request_id, RequestStatus.FINISHED_ERROR, why)
                results.append(out or RequestOutput(request_id, "", [], True, "error", error=why))
        self.log.debug(
            "step_completed",
            step_id=plan.step_id,
            num_reqs=plan.num_reqs,
            num_tokens=plan.num_tokens,
            duration_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )
        return results

    def _fail_step(self, plan, outputs: list[ModelRunnerOutput], errors: list[str]) -> list[RequestOutput]:
        """A step some stage failed: its requests fail with the first error; the others go on."""
        self.log.error("step_failed", step_id=plan.step_id, errors=errors)
        failed = [(request_id, errors[0]) for request_id in self.process_failed_step(plan, outputs)]
        outs = (self.abort(rid, RequestStatus.FINISHED_ERROR, why) for rid, why in failed + self.take_failed_requests())
        return [out for out in outs if out is not None]

    def generate(
        self, prompts: Iterable[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run prompts to completion (continuous batching) and return them in order."""
        prompts = list(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.add_request(prompt, sp))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt leaves no orphaned requests behind
                self.abort(rid)
            raise
        completions = {rid: Completion(rid) for rid in ids}
        # Until the KV connector is done too: saves of these requests are then in the store.
        while self.has_unfinished_requests() or self.has_pending_transfers():
            for out in self.step():
                if out.request_id in completions:
                    completions[out.request_id].add(out)
        return [completions[rid] for rid in ids]

    def close(self) -> None:
        """Stop the KV connectors' transfer threads and release their stores."""
        self.executor.close()
        if self.kv_connector is not None:
            self.kv_connector.close()
