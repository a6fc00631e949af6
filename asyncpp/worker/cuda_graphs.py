"""Steps replayed from CUDA graphs captured at start-up, one per size (and ring slot).

A step of `n` tokens is padded to the smallest captured size `B >= n` and
replayed, whatever it carries: decodes, a request's last token and its drafts
(speculative decoding), prefill chunks, or a mix. The attention kernel takes
every query token as a row of its own (`_KernelRows`: its position, slot,
block-table row and context length; a prefill chunk's token attends its
prefix like a decode at its position, the chunk's earlier tokens included,
whose K/V the layer writes first), so one launch shape serves any mix and no
uniform query length is needed (`num_reqs` is never adjusted, seed 002). The
graph reads its inputs from static buffers (`input_ids`, `positions`,
`slot_mapping`, the per-row block table, `context_lens`) that `run` fills
before the replay, and on a non-first stage straight from the activation
ring slot the previous stage wrote into. The ring slots ARE the graphs'
input addresses (one graph per size and slot), so activations are copied
once, by the sender; vLLM's PP graphs copy the received tensors into the
graph's buffer a second time. The logits of the rows that sample are taken
from the graph's output outside it.

Padding rows compute garbage that nobody reads: their K/V go to a padding
block past the last block the engine hands out (`pad_slot`), and they attend
one key. Only steps larger than the largest size (and the torch attention
path, which has no rows) run eagerly. In-process stages (no ring) read from a
buffer of their own (`copy_inputs`), into which the previous stage's output
is copied. With `capture=False` the same static-buffer path runs without
graphs: that is how CPU tests check the padding and buffer logic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from asyncpp.logging import get_logger
from asyncpp.model.attention import AttentionMetadata, _KernelRows
from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.model.llama import LlamaModel
from asyncpp.worker.step_inputs import StepInputs


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: eager replay (capture=False)
    output: IntermediateTensors | torch.Tensor | None  # the graph's output buffers (padded rows)


class StepGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        decode_kernel,
        *,
        sizes: tuple[int, ...],
        block_size: int,
        max_blocks_per_req: int,
        pad_slot: int,
        input_slots: list[IntermediateTensors] | None,  # non-first stage: the ring's slots, full size
        copy_inputs: bool = False,  # True: input_slots is our own buffer, activations are copied in
        device: torch.device,
        capture: bool,
    ) -> None:
        if not sizes:
            raise ValueError("no CUDA graph sizes")
        if not model.is_first and not input_slots:
            raise ValueError("a non-first stage's graphs need the input slots they read")
        self.model, self.kv_caches, self.decode_kernel = model, kv_caches, decode_kernel
        self.sizes = tuple(sorted(sizes))
        self.block_size, self.pad_slot = block_size, pad_slot
        self.input_slots = input_slots if not model.is_first else None
        self.device, self.capture, self.copy_inputs = device, capture, copy_inputs
        max_b = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_b, **i64)
        self.positions = torch.zeros(max_b, **i64)
        self.slot_mapping = torch.full((max_b,), pad_slot, **i64)
        self.block_table = torch.zeros(max_b, max_blocks_per_req, **i64)
        self.context_lens = torch.ones(max_b, **i64)
        self.rows = torch.arange(max_b, **i64)
        self.max_context_len = max_blocks_per_req * block_size
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.num_runs: dict[int, int] = dict.fromkeys(self.sizes, 0)  # steps run per size
        self.pool = None
        self.log = get_logger(role="stage", start_layer=model.start_layer)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, inputs: StepInputs) -> int | None:
        """The captured size for this step, or None to run it eagerly (too large, no attention rows)."""
        n = inputs.num_tokens
        if n > self.max_size or inputs.attn_meta.kernel_rows is None:
            return None
        return next(b for b in self.sizes if b >= n)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (size, slot) once, largest first so the smaller ones reuse its memory."""
        t0 = time.perf_counter()
        slots = range(len(self.input_slots)) if self.input_slots is not None else range(1)
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for slot in slots:
                self.captured[(size, slot)] = self._capture(size, slot)
        if self.capture:
            torch.cuda.synchronize(self.device)
        self.log.info(
            "cuda_graphs_captured",
            sizes=list(self.sizes),
            num_graphs=len(self.captured),
            captured=self.capture,
            duration_s=round(time.perf_counter() - t0, 3),
        )

    def _forward(self, size: int, slot: int) -> IntermediateTensors | torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            groups=[],
            block_size=self.block_size,
            kernel_rows=_KernelRows(
                fn=self.decode_kernel,
                rows=self.rows[:size],
                block_table=self.block_table[:size],
                context_lens=self.context_lens[:size],
                max_context_len=self.max_context_len,
            ),
        )
        intermediate = self.input_slots[slot].narrow(size) if self.input_slots is not None else None
        return self.model(
            self.input_ids[:size] if self.model.is_first else None,
            self.positions[:size],
            self.kv_caches,
            meta,
            intermediate,
        )

    def _capture(self, size: int, slot: int) -> _Captured:
        self._pad(0, size)  # every row is padding: K/V of the capture runs go to the padding slot
        if not self.capture:
            return _Captured(None, None)
        for _ in range(2):  # compile Triton kernels, let cuBLAS pick its algorithms
            self._forward(size, slot)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self._forward(size, slot)
        return _Captured(graph, output)

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.pad_slot
        self.context_lens[start:end] = 1
        self.block_table[start:end, 0] = 0

    def slot_of(self, intermediate: IntermediateTensors | None) -> int | None:
        """The ring slot `intermediate` is a view of (its rows start where the slot's do), or None."""
        if self.input_slots is None:
            return 0
        for slot, tensors in enumerate(self.input_slots):
            if all(intermediate[k].data_ptr() == tensors[k].data_ptr() for k in tensors.keys()):
                return slot
        return None

    @torch.inference_mode()
    def run(
        self, size: int, inputs: StepInputs, intermediate: IntermediateTensors | None
    ) -> IntermediateTensors | torch.Tensor:
        """Load the step into the static buffers, replay `size`'s graph, return its first `n` rows."""
        n = inputs.num_tokens
        rows = inputs.attn_meta.kernel_rows
        width = rows.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"a request uses {width} blocks, more than the graphs' {self.block_table.shape[1]}")
        slot = self.slot_of(intermediate)
        if slot is None:
            if not self.copy_inputs:
                raise ValueError("the step's activations are not in any ring slot the graphs were captured for")
            slot = 0  # in-process stages: the previous stage's output is copied into our own buffer
            for key in self.input_slots[0].keys():
                self.input_slots[0][key][:n].copy_(intermediate[key][:n])
        if self.model.is_first:
            self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.attn_meta.slot_mapping)
        self.block_table[:n, :width].copy_(rows.block_table)
        self.context_lens[:n].copy_(rows.context_lens)
        self._pad(n, size)
        captured = self.captured[(size, slot)]
        self.num_runs[size] += 1
        if captured.graph is None:
            output = self._forward(size, slot)
        else:
            captured.graph.replay()
            output = captured.output
        if isinstance(output, IntermediateTensors):
            return output.narrow(n)
        return output[:n]
