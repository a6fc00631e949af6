"""`ModelRunner`: runs one stage's slice of the model for a `StepPlan`, in two phases.

1. `execute_model(plan, intermediate)`: prepare inputs in persistent buffers
   and run the slice. A non-last stage returns the `IntermediateTensors` to
   hand to the next stage. The last stage computes logits for the requests
   that sample and keeps them in an explicit `ExecuteModelState`. The
   preparation, everything that needs neither the previous stage's
   activations nor sampled tokens, may run ahead as `prepare_step(plan)`: a
   stage after the first calls it before it waits for its activations, so the
   wait hides it (the first stage's inputs need the tokens: it does not).
2. `sample_tokens()` (last stage only): sample from that state (verifying the
   drafts a request's row carries: `asyncpp.speculative.rejection`), run the
   speculative proposer (its drafts go out with the sampled tokens, tagged by
   request in this step's output), then the KV connector's `post_forward`, and
   return the step's `ModelRunnerOutput`. A non-last stage ends its step with
   `finish_step()` instead (after handing off its activations), which returns
   `ModelRunnerOutput.with_kv_conn_output_only(...)`.
   `sample_tokens_async()` is the same step for a single stage that may leave
   the tokens on the device (async output, `asyncpp.worker.async_output`):
   the next `execute_model` reads them there, and the output is built later.
   The last of several stages may hand its draw on while it is still on the
   device (`on_sampled`: the token ring, `asyncpp.transport.token_ring`); the
   first records such tokens with `record_on_device`.

Every step binds the plan's KV connector metadata before the forward
(`pre_forward`, which also starts loads), empty steps included, and clears
it in `post_forward`; a step that failed anywhere on this stage ends with
`abort_step(plan)`, which binds it if that never happened, saves only what a
finished forward wrote, and still collects the connector's reports.

The runner keeps per-request sampling state (seeded generators, token history
for penalties) keyed by request id; everything else comes from the plan. The
first stage also keeps each request's latest sampled token (`record_sampled`;
its own when it is also the last stage), which fills the placeholders of a
plan scheduled before that token was known (async scheduling).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncpp.core.plan import PLACEHOLDER_TOKEN_ID, StepPlan
from asyncpp.kernels.decode_attention import decode_attention_kernel
from asyncpp.kernels.triton_attention import triton_attention_kernel
from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.model.llama import LlamaModel
from asyncpp.sampling.output import SamplerOutput
from asyncpp.sampling.sampler import RequestSamplingState, Sampler
from asyncpp.speculative.proposer import Proposer
from asyncpp.speculative.rejection import RejectionSampler
from asyncpp.structured.sampling import StructuredSampling
from asyncpp.step_phases import NO_PHASES, StepPhases, _NoPhases
from asyncpp.worker.async_output import AsyncSample, DeviceSample, DeviceTokens, PendingOutput
from asyncpp.worker.cuda_graphs import StepGraphs
from asyncpp.worker.kv_connector import KVConnectorWrapper
from asyncpp.worker.outputs import Logprobs, ModelRunnerOutput
from asyncpp.worker.step_inputs import StepInputBuffers, StepInputs


@dataclass
class ExecuteModelState:
    """What `sample_tokens` needs from `execute_model` of the same step."""

    step_id: int
    sampling_req_ids: list[str]
    logits: torch.Tensor | None  # [num logits rows, vocab_size]; None when nothing samples
    finished_req_ids: frozenset[str]  # for the KV connector's post_forward (never its output)
    has_forward: bool = True  # False for a plan with no tokens: the connector is only polled
    # Per sampling request, the drafts its rows verify (one row each before its last); None: no drafts.
    draft_token_ids: list[list[int]] | None = None


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device | str = "cpu",
        use_decode_kernel: bool = True,
        kv_connector: KVConnectorWrapper | None = None,
        graph_sizes: tuple[int, ...] = (),
        max_model_len: int = 0,
        pad_slot: int | None = None,
        isa: str | None = None,
        pp_rank: int = 0,
        layer_range: tuple[int, int] | None = None,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        structured: StructuredSampling | None = None,
    ) -> None:
        """`layer_range`: the layers this stage runs when a plan names no `layer_bounds` (None: every
        layer of `model`, which may hold more: `parallel.shift_layers`); `pp_rank` finds its range in
        a plan's bounds. `graph_sizes`: decode batch sizes run from static buffers (captured as CUDA graphs on CUDA,
        plain replays on CPU); they need the decode kernel, `max_model_len` and a `pad_slot` past the
        engine's blocks. `isa`: the level CPU kernels are built for (None: the CPU's best).
        `proposer` (last stage): drafts up to `num_speculative_tokens` tokens per sampled request.
        `structured` (last stage): the grammar matchers of requests asking for structured output."""
        if len(kv_caches) != model.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for a slice of {model.num_layers} layers")
        self.model = model
        self.kv_caches = kv_caches  # one (K, V) per layer held, shared ones included
        self.pp_rank = pp_rank
        self.layer_range = layer_range or (model.start_layer, model.end_layer)
        self.device = torch.device(device)
        dtype, arch = kv_caches[0][0].dtype, model.arch
        decode_kernel = None
        if use_decode_kernel:  # the C kernel on CPU, the Triton one on CUDA; else torch's SDPA paths
            heads = (arch.num_heads, arch.num_kv_heads, arch.head_dim)
            decode_kernel = decode_attention_kernel(self.device, dtype, *heads, isa=isa) or triton_attention_kernel(
                self.device, dtype, *heads, block_size=block_size
            )
        self.decode_kernel = decode_kernel
        self.graphs: StepGraphs | None = None
        self.graph_sizes = tuple(graph_sizes) if decode_kernel is not None else ()
        self.max_model_len, self.pad_slot = max_model_len, pad_slot
        self.max_num_batched_tokens, self.block_size = max_num_batched_tokens, block_size
        max_blocks = -(-max_model_len // block_size) if max_model_len else 0
        self.buffers = StepInputBuffers(max_num_batched_tokens, block_size, self.device, dtype, decode_kernel, max_blocks)
        self.sampler = Sampler(model.arch.vocab_size, self.device, isa) if model.is_last else None
        self.rejection_sampler = RejectionSampler(self.sampler) if self.sampler is not None else None
        if proposer is not None and not model.is_last:
            raise ValueError("a proposer runs on the last stage only")
        self.proposer = proposer
        self.structured = structured if model.is_last else None
        self.num_speculative_tokens = num_speculative_tokens
        self.sampling_states: dict[str, RequestSamplingState] = {}
        self.sampled_token_ids = DeviceTokens()  # first stage: latest sampled token per request
        # First stage: the drafts proposed with it; last stage: its own latest proposals, and whether
        # its latest verification accepted every draft (else a continuation placed after them is void).
        self.latest_drafts: dict[str, list[int]] = {}
        self.accepted_all: dict[str, bool] = {}
        self.execute_state: ExecuteModelState | None = None
        self.prepared: tuple[int, StepInputs | None] | None = None  # (step id, its inputs) from `prepare_step`
        self.forward_step_id = -1  # the latest step whose forward ran to its end (its KV is written)
        self.kv_connector = kv_connector or KVConnectorWrapper()
        self.phases: StepPhases | _NoPhases = NO_PHASES  # the stage sets its own (`asyncpp.step_phases`)
        # Last of several stages, token ring: called with (step_id, req_ids, tokens on the device) as
        # soon as a step without drafts samples them, before they are copied to the host.
        self.on_sampled: Callable[[int, list[str], torch.Tensor], None] | None = None
        self.kv_connector.register_kv_caches(kv_caches, model.start_layer)

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def build_graphs(self, input_slots: list[IntermediateTensors] | None = None) -> None:
        """Capture the decode graphs (a non-first stage: reading `input_slots`, else a buffer of its own)."""
        if not self.graph_sizes:
            return
        if self.pad_slot is None or self.max_model_len <= 0:
            raise ValueError("decode graphs need a padding slot and max_model_len")
        copy_inputs = not self.model.is_first and input_slots is None
        if copy_inputs:
            dtype = self.kv_caches[0][0].dtype
            input_slots = [IntermediateTensors.allocate(self.max_num_batched_tokens, self.model.arch.hidden_size, dtype, self.device)]
        self.graphs = StepGraphs(
            self.model,
            self.kv_caches,
            self.decode_kernel,
            sizes=self.graph_sizes,
            block_size=self.block_size,
            max_blocks_per_req=-(-self.max_model_len // self.block_size),
            pad_slot=self.pad_slot,
            input_slots=input_slots,
            copy_inputs=copy_inputs,
            device=self.device,
            capture=self.device.type == "cuda",  # CPU: the same static buffers, no graphs
        )
        self.graphs.capture_all()

    @torch.inference_mode()
    def prepare_step(self, plan: StepPlan) -> None:
        """The step's work before its forward: the requests' states, the KV connector's binding (which
        starts loads), the inputs. `execute_model` of the same plan then runs the forward on them; it
        prepares itself when this was not called. On the first stage the inputs take the sampled tokens
        of `plan.after_step_id`: call it only once they are recorded."""
        if self.execute_state is not None:
            raise RuntimeError(f"execute_model(step {plan.step_id}) before sample_tokens of step {self.execute_state.step_id}")
        phases = self.phases
        self._update_states(plan)
        finished = frozenset(plan.finished_req_ids)
        self.execute_state = ExecuteModelState(plan.step_id, [], None, finished, has_forward=not plan.is_empty)
        phases.mark("update_states")
        self.kv_connector.pre_forward(plan)
        phases.mark("kv_pre_forward")
        inputs = None
        if not plan.is_empty:
            void = self._void_continuations(plan) if self.is_last and plan.after_step_id is not None else frozenset()
            first = self.model.is_first
            inputs = self.buffers.prepare(plan, self.sampled_token_ids if first else None, self.latest_drafts, void)
            phases.mark("prepare_inputs")
        self.prepared = (plan.step_id, inputs)

    @torch.inference_mode()
    def execute_model(
        self, plan: StepPlan, intermediate: IntermediateTensors | None = None
    ) -> IntermediateTensors | None:
        if self.prepared is None or self.prepared[0] != plan.step_id:
            self.prepare_step(plan)
        (_, inputs), self.prepared = self.prepared, None
        if inputs is None:  # a plan with no tokens: the connector is only polled
            return None
        phases = self.phases
        finished = self.execute_state.finished_req_ids
        phases.gpu_begin("forward")
        if not self.model.is_first:
            if intermediate is None:
                raise ValueError(f"step {plan.step_id}: stage {self.model.start_layer}.. needs intermediate tensors")
            if intermediate.num_tokens < inputs.num_tokens:
                raise ValueError(
                    f"step {plan.step_id}: intermediate tensors hold {intermediate.num_tokens} tokens, "
                    f"the plan has {inputs.num_tokens}"
                )
            intermediate = intermediate.narrow(inputs.num_tokens)
            if intermediate["hidden_states"].device != self.device:  # in-process stages on different GPUs
                intermediate = IntermediateTensors({k: v.to(self.device) for k, v in intermediate.tensors.items()})
        layer_range = self._layer_range(plan)
        size = self.graphs.padded_size(inputs) if self.graphs is not None else None
        if size is not None:
            out = self.graphs.run(size, inputs, intermediate)
        else:
            out = self.model(
                inputs.input_ids if self.model.is_first else None,
                inputs.positions,
                self.kv_caches,
                inputs.attn_meta,
                intermediate,
                layer_range,
            )
        self.forward_step_id = plan.step_id
        if not self.is_last:
            phases.mark("forward")  # graph replay, or the eager ops' launches (GPU: gpu_ms)
            phases.gpu_end("forward")
            return out
        logits = self.model.compute_logits(out[inputs.logits_indices]) if inputs.sampling_req_ids else None
        phases.mark("forward")
        phases.gpu_end("forward")
        self.execute_state = ExecuteModelState(
            plan.step_id, inputs.sampling_req_ids, logits, finished, draft_token_ids=inputs.draft_token_ids
        )
        return None

    def _void_continuations(self, plan: StepPlan) -> frozenset[str]:
        """Continuations placed after drafts the plan before did not all accept (the scheduler drops
        them too): their rows run, but nothing is sampled for them."""
        return frozenset(
            r.request_id
            for r in plan.scheduled
            if r.token_ids[0] == PLACEHOLDER_TOKEN_ID and not self.accepted_all.get(r.request_id, True)
        )

    def _layer_range(self, plan: StepPlan) -> tuple[int, int]:
        """The layers this step runs here: the plan's bounds around this stage, else the default."""
        if not plan.layer_bounds:
            return self.layer_range
        if self.graphs is not None:
            raise ValueError(f"step {plan.step_id}: layer bounds with decode graphs (they capture fixed layers)")
        starts = (0, *plan.layer_bounds, self.model.arch.num_layers)
        if self.pp_rank + 1 >= len(starts):
            raise ValueError(f"step {plan.step_id}: layer bounds {plan.layer_bounds} name no range for stage {self.pp_rank}")
        return starts[self.pp_rank], starts[self.pp_rank + 1]

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """Last stage: sample -> proposer -> the connector's post_forward (in that order, seed 003)."""
        state, self.execute_state = self.execute_state, None
        if state is None or not self.is_last:
            raise RuntimeError("sample_tokens() without a preceding execute_model() on the last stage")
        phases = self.phases
        phases.gpu_begin("sample")
        output = self._sample(state) if state.logits is not None else None
        phases.mark("sample")  # with the sampled tokens' copy to the host
        phases.gpu_end("sample")
        drafts = self.propose_drafts(state, output)
        if drafts is not None:
            self.latest_drafts.update(zip(output.req_ids, drafts))
            output = dataclasses.replace(output, draft_token_ids=drafts)
            phases.mark("propose_drafts")
        kv_output = self.kv_connector.post_forward(state.finished_req_ids, wait_for_save=state.has_forward)
        phases.mark("kv_post_forward")
        if output is None:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        return dataclasses.replace(output, kv_connector_output=kv_output) if kv_output is not None else output

    def can_defer(self) -> bool:
        """Whether the pending step's tokens may stay on the device past `sample_tokens_async`
        (`asyncpp.worker.async_output`): a single stage (it fills its own placeholders), no
        proposer, no KV connector, and a draw that needs nothing more of the host."""
        state = self.execute_state
        return (
            state is not None
            and state.logits is not None
            and state.draft_token_ids is None
            and self.model.is_first
            and self.is_last
            and self.proposer is None
            and not self.kv_connector.is_active
            and not self.sampler.reads_history([self.sampling_states[r] for r in state.sampling_req_ids])
            and not (self.structured is not None and self.structured.has_any(state.sampling_req_ids))
        )

    @torch.inference_mode()
    def sample_tokens_async(self) -> PendingOutput:
        """`sample_tokens`, except that where `can_defer`, the tokens stay on the device: the next
        `execute_model` reads them there, and the output is built when the caller `get`s it (after
        enqueueing the next step, so that the host's work overlaps this step's computation)."""
        if not self.can_defer():
            return PendingOutput.ready(self.sample_tokens())
        state, self.execute_state = self.execute_state, None
        phases = self.phases
        phases.gpu_begin("sample")
        req_states = [self.sampling_states[r] for r in state.sampling_req_ids]
        sample = AsyncSample(state.step_id, state.sampling_req_ids, self.sampler.sample_on_device(state.logits, req_states))
        self.sampled_token_ids.add_pending(sample)
        phases.mark("sample")  # launched only: the tokens come to the host in `get`
        phases.gpu_end("sample")
        kv_output = self.kv_connector.post_forward(state.finished_req_ids, wait_for_save=state.has_forward)

        def finish() -> ModelRunnerOutput:
            token_ids = sample.token_ids()
            for req_state, token_id in zip(req_states, token_ids):
                req_state.output_token_ids.append(token_id)
            self.sampled_token_ids.resolve(sample, token_ids)
            return ModelRunnerOutput(
                req_ids=sample.req_ids,
                sampled_token_ids=[[t] for t in token_ids],
                logprobs=[None] * len(token_ids),
                kv_connector_output=kv_output,
            )

        return PendingOutput(sample, finish)

    def finish_step(self) -> ModelRunnerOutput:
        """Non-last stage, after its activations are handed off: the connector's reports only."""
        state, self.execute_state = self.execute_state, None
        if state is None or self.is_last:
            raise RuntimeError("finish_step() without a preceding execute_model() on a non-last stage")
        kv_output = self.kv_connector.post_forward(state.finished_req_ids, wait_for_save=state.has_forward)
        self.phases.mark("kv_post_forward")
        return ModelRunnerOutput.with_kv_conn_output_only(kv_output)

    def abort_step(self, plan: StepPlan) -> ModelRunnerOutput:
        """A step that failed on this stage, before, in or after its forward: drop its state and end
        its KV transfers (loads started or reported failed; saves only of what the forward wrote)."""
        self.execute_state = self.prepared = None
        kv_output = self.kv_connector.abort_step(plan, is_forward_done=self.forward_step_id == plan.step_id)
        return ModelRunnerOutput.with_kv_conn_output_only(kv_output)

    def propose_drafts(self, state: ExecuteModelState, output: ModelRunnerOutput | None) -> list[list[int]] | None:
        """The proposer's drafts for each request that just sampled (`output.req_ids`), after sampling
        and before the connector's post_forward (seed 003); they go out tagged with the request in
        this step's output. None without a proposer or when nothing sampled."""
        if self.proposer is None or output is None:
            return None
        k = self.num_speculative_tokens
        return [self.proposer.propose(req_id, k) for req_id in output.req_ids]

    def _sample(self, state: ExecuteModelState) -> ModelRunnerOutput:
        req_states = [self.sampling_states[r] for r in state.sampling_req_ids]
        logits = state.logits
        if self.structured is not None and self.structured.has_any(state.sampling_req_ids):
            logits = self.structured.mask(state.sampling_req_ids, logits, state.draft_token_ids)
        if state.draft_token_ids is not None:
            verified = self.rejection_sampler(logits, req_states, state.draft_token_ids)
            sampled, logprobs = verified.token_ids, verified.logprobs
            for req_id, drafts, token_ids in zip(state.sampling_req_ids, state.draft_token_ids, sampled):
                self.accepted_all[req_id] = len(token_ids) == len(drafts) + 1
        else:
            out = self._draw(state.step_id, state.sampling_req_ids, logits, req_states)
            sampled = [[t] for t in out.sampled_token_ids.tolist()]
            logprobs = _logprobs_lists(out, req_states)
            if self.proposer is not None:  # nothing to verify: a continuation after it is valid
                self.accepted_all.update((req_id, True) for req_id in state.sampling_req_ids)
        for req_id, req_state, token_ids in zip(state.sampling_req_ids, req_states, sampled):
            req_state.output_token_ids.extend(token_ids)
            if self.proposer is not None:
                self.proposer.extend(req_id, token_ids)
            if self.structured is not None:
                self.structured.advance(req_id, token_ids)
        if self.model.is_first:
            self.record_sampled(state.sampling_req_ids, [ids[-1] for ids in sampled])
        return ModelRunnerOutput(req_ids=state.sampling_req_ids, sampled_token_ids=sampled, logprobs=logprobs)

    def _draw(self, step_id: int, req_ids: list[str], logits: torch.Tensor, req_states) -> SamplerOutput:
        """The sampler's draw; with `on_sampled` (token ring) and nothing the host must add (no
        proposer, logprobs, penalties or seeds), handed on while still on the device."""
        if self.on_sampled is None or self.proposer is not None or self.sampler.reads_history(req_states):
            return self.sampler(logits, req_states)
        sample = AsyncSample(step_id, req_ids, self.sampler.sample_on_device(logits, req_states))
        # Its copy to the host is enqueued before the ring's write: the first stage's next step,
        # which waits for that write, cannot take a shared GPU ahead of the copy this stage awaits.
        self.on_sampled(step_id, req_ids, sample.device_tensor)
        return SamplerOutput(sample.host_tensor())

    def record_on_device(self, step_id: int, req_ids: list[str], token_ids: torch.Tensor) -> None:
        """First stage: the tokens a step sampled, on this device (token ring), for later placeholders."""
        self.sampled_token_ids.add_pending(DeviceSample(step_id, req_ids, token_ids))

    def record_sampled(self, req_ids: list[str], token_ids: list[int], drafts: list[list[int]] | None = None) -> None:
        """First stage: the tokens a step sampled (and the drafts proposed after them), for the
        placeholders of later plans."""
        self.sampled_token_ids.record(req_ids, token_ids)
        if drafts:
            self.latest_drafts.update(zip(req_ids, drafts))

    def _update_states(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self.sampling_states.pop(req_id, None)
            self.sampled_token_ids.forget(req_id)
            self.latest_drafts.pop(req_id, None)
            self.accepted_all.pop(req_id, None)
            if self.proposer is not None:
                self.proposer.finish(req_id)
            if self.structured is not None:
                self.structured.finish(req_id)
        if not self.is_last:
            return
        for new in plan.new_requests:
            if self.proposer is not None:  # resumed after preemption: rebuilt from its tokens so far
                self.proposer.start(new.request_id, [*new.prompt_token_ids, *new.output_token_ids])
            # A request resumed after preemption simply gets a fresh state: seeded rows are
            # reseeded from (seed, tokens so far) before every draw, so nothing carries over.
            self.sampling_states[new.request_id] = RequestSamplingState.create(
                new.sampling_params, list(new.prompt_token_ids), list(new.output_token_ids), self.device
            )
            spec = new.sampling_params.structured_outputs
            if spec is not None and self.structured is not None:
                self.structured.start(new.request_id, spec, new.output_token_ids, new.sampling_params.ignore_eos)


def _logprobs_lists(out, req_states: list[RequestSamplingState]) -> list[list[Logprobs] | None]:
    if out.logprobs is None:
        return [None] * len(req_states)
    token_lps = out.logprobs.tolist()
    top_ids = out.top_logprob_token_ids.tolist() if out.top_logprob_token_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[list[Logprobs] | None] = []
    for i, req_state in enumerate(req_states):
        n = req_state.params.logprobs
        if n is None:
            result.append(None)
            continue
        ids = top_ids[i][:n] if top_ids is not None else []
        lps = top_lps[i][:n] if top_lps is not None else []
        result.append([Logprobs(token_lps[i], ids, lps)])
    return result
