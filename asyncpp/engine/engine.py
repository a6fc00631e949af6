"""`Engine`: the in-process engine. schedule -> execute -> update -> detokenize.

`add_request` validates and tokenizes (touching no state on error), `step`
runs one scheduled step and returns the streamed deltas, `abort` finishes a
request and frees its blocks, `generate` is the synchronous convenience.
The pipeline runtime wraps the same scheduler and processors around stage
processes instead of the in-process executor.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from asyncpp.config import EngineConfig
from asyncpp.core.request import Request, RequestStatus
from asyncpp.core.scheduler import Scheduler
from asyncpp.engine.executor import InProcessExecutor
from asyncpp.engine.input_processor import InputProcessor, Prompt
from asyncpp.engine.output_processor import OutputProcessor
from asyncpp.engine.outputs import Completion, RequestOutput
from asyncpp.errors import InvalidRequestError
from asyncpp.kv.block_manager import BlockManager
from asyncpp.logging import get_logger
from asyncpp.model.arch import ModelArch
from asyncpp.model.split import compute_layer_ranges, head_cost_in_layers
from asyncpp.sampling.params import SamplingParams
from asyncpp.tokenizer import load_tokenizer
from asyncpp.weights import read_arch
from asyncpp.worker.outputs import ModelRunnerOutput
from asyncpp.worker.stage import build_model_slice, build_runner, stage_num_blocks, torch_dtype


@dataclass(frozen=True)
class EngineCapacity:
    """Values found at start-up, kept apart from the frozen config."""

    num_blocks: int
    block_size: int
    max_model_len: int
    layer_ranges: list[tuple[int, int]]


def resolve_capacity(config: EngineConfig, arch: ModelArch) -> EngineCapacity:
    if config.model.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"model.max_model_len {config.model.max_model_len} exceeds the model's "
            f"max_position_embeddings {arch.max_position_embeddings}"
        )
    ranges = compute_layer_ranges(
        arch.num_layers, config.parallel.pp_size, config.parallel.layer_split, head_cost_in_layers(arch)
    )
    dtype = torch_dtype(config.model.dtype)
    num_blocks = config.cache.num_kv_blocks_override or min(
        stage_num_blocks(arch, end - start, config.cache.kv_cache_memory_mb, config.cache.block_size, dtype)
        for start, end in ranges
    )
    return EngineCapacity(num_blocks, config.cache.block_size, config.model.max_model_len, ranges)


class EngineCore:
    """Scheduler + request state + detokenization; no model. Shared by both runtimes."""

    def __init__(self, config: EngineConfig, arch: ModelArch, tokenizer: Any, capacity: EngineCapacity) -> None:
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
        )
        self.input_processor = InputProcessor(tokenizer, arch.vocab_size, capacity.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self.log = get_logger(role="engine")

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request_id in self.output_processor or self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError("request_id", f"duplicate request id {request_id!r}")
        prompt_token_ids = self.input_processor.process(prompt, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        self.log.info("request_received", request_id=request_id, num_prompt_tokens=len(prompt_token_ids))
        return request_id

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

    def process_output(self, plan: Any, output: ModelRunnerOutput) -> list[RequestOutput]:
        logprobs = dict(zip(output.req_ids, output.logprobs, strict=True))
        updates = self.scheduler.update_from_output(plan, output.sampled_by_request())
        results = []
        for update in updates:
            out = self.output_processor.process(
                update.request_id,
                update.new_token_ids,
                update.finish_reason,
                update.stop_reason,
                logprobs.get(update.request_id),
            )
            if out is None:
                continue
            if out.finished and update.finish_reason is None:  # a stop string ended it
                self.scheduler.finish_requests([update.request_id], RequestStatus.FINISHED_STOPPED)
            if out.finished:
                self.log.info("request_finished", request_id=out.request_id, finish_reason=out.finish_reason)
            results.append(out)
        return results


class Engine(EngineCore):
    """The in-process engine: every stage runs in this process."""

    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(config.parallel.num_threads)
        arch = read_arch(config.model.source, config.model.path_or_none)
        tokenizer = load_tokenizer(config.model.source, config.model.path_or_none, arch.vocab_size)
        capacity = resolve_capacity(config, arch)
        super().__init__(config, arch, tokenizer, capacity)
        dtype = torch_dtype(config.model.dtype)
        runners = []
        for start, end in capacity.layer_ranges:
            model = build_model_slice(
                config.model.source,
                config.model.path_or_none,
                arch,
                start,
                end,
                dtype,
                config.model.device,
                config.model.linear_kernel,
            )
            runners.append(
                build_runner(
                    model,
                    num_blocks=capacity.num_blocks,
                    block_size=capacity.block_size,
                    max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                    dtype=dtype,
                    device=config.model.device,
                )
            )
        self.executor = InProcessExecutor(runners)
        self.log.info("engine_ready", num_blocks=capacity.num_blocks, layer_ranges=capacity.layer_ranges)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        t0 = time.perf_counter()
        output = self.executor.execute(plan)
        results = self.process_output(plan, output)
        self.log.debug(
            "step_completed",
            step_id=plan.step_id,
            num_reqs=plan.num_reqs,
            num_tokens=plan.num_tokens,
            duration_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )
        return results

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
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in completions:
                    completions[out.request_id].add(out)
        return [completions[rid] for rid in ids]
