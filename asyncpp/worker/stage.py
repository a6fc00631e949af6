"""Build one pipeline stage from plain values: its model slice, KV cache and runner.

Used by the in-process engine (all stages in one process, chained) and by
stage processes alike, so both run exactly the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from asyncpp.config import EngineConfig, SpeculativeConfig
from asyncpp.device import is_cuda
from asyncpp.dtypes import torch_dtype  # noqa: F401  (re-exported for callers)
from asyncpp.kernels.fused_ops import fused_ops
from asyncpp.kernels.isa import native_level
from asyncpp.kernels.layer_stack import LayerStack
from asyncpp.kernels.linear_bf16 import bf16_native_kernel, linear_bf16_kernel, use_fma_min_rows
from asyncpp.kernels.qlinear import qlinear_kernel
from asyncpp.kv.sizing import num_blocks_for_budget
from asyncpp.kv_transfer.base import KVConnectorWorker
from asyncpp.logging import get_logger
from asyncpp.model.arch import ModelArch
from asyncpp.model.llama import LlamaModel
from asyncpp.model.logits_head import float32_logits_head
from asyncpp.model.native_linear import NativeKernel, NativeWeights
from asyncpp.model.packed_linear import can_pack, pack_linear_layers
from asyncpp.speculative.proposer import create_proposer
from asyncpp.structured.sampling import StructuredSampling
from asyncpp.weights import load_weights
from asyncpp.weights.base import StoredTensor
from asyncpp.worker.kv_cache import allocate_kv_caches
from asyncpp.worker.kv_connector import KVConnectorWrapper
from asyncpp.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from asyncpp.structured.compiler import GrammarCompiler


def build_model_slice(
    source: str,
    path: str | None,
    arch: ModelArch,
    start_layer: int,
    end_layer: int,
    dtype: torch.dtype,
    device: str,
    linear_kernel: str = "auto",
    isa: str | None = None,
    weight_format: str = "float",
    fma_min_rows: tuple[int | None, int | None] = (None, None),
) -> LlamaModel:
    """Load and build layers [start_layer, end_layer).

    `isa`: the level CPU kernels are built for (None: the CPU's best).
    `weight_format`: "float" dequantizes to `dtype` at load; "native" keeps the
    file's format (GGUF blocks, float16, ...) and computes in float32 through
    `asyncpp.kernels.qlinear`, or in bfloat16 (AVX512-BF16) through
    `linear_bf16`'s block variant (bfloat16 inputs times the exact weights).
    `fma_min_rows`: the compute plan's (float weights, GGUF blocks) rows from which
    the bfloat16 kernel multiplies with float32 FMA (the same bits)."""
    log = get_logger(role="stage", start_layer=start_layer, end_layer=end_layer)
    t0 = time.perf_counter()
    native = weight_format == "native"
    if weight_format not in ("float", "native"):
        raise ValueError(f"model.weight_format must be 'float' or 'native', got {weight_format!r}")
    on_cpu = torch.device(device).type == "cpu"
    if native and not (on_cpu and dtype in (torch.float32, torch.bfloat16)):
        raise ValueError(f"model.weight_format = 'native' computes in float32 or bfloat16 on CPU, not {dtype} on {device}")
    qlinear = None  # the kernel of the stored-format linears, when there are any
    if on_cpu and dtype == torch.float32 and (native or linear_kernel == "auto"):
        qlinear = qlinear_kernel(isa)
    elif native and dtype == torch.bfloat16:
        qlinear = bf16_native_kernel(isa)
        if qlinear is None:
            raise ValueError(f"model.weight_format = 'native' in bfloat16 needs AVX512-BF16 (cpu_isa {isa})")
    if native and qlinear is None:
        raise RuntimeError("model.weight_format = 'native' needs the qlinear C kernel, which could not be built")
    tensors = load_weights(
        source,
        path,
        start_layer=start_layer,
        end_layer=end_layer,
        need_embed=start_layer == 0,
        need_head=end_layer == arch.num_layers,
        native=native,
    )
    if qlinear is not None and not native:  # float32 weights through the same batch-invariant kernel
        tensors = StoredTensor.from_floats(tensors)
    model = LlamaModel(arch, start_layer, end_layer)
    model.load_weights(tensors, NativeWeights(qlinear) if qlinear is not None else None)
    del tensors
    model = model.to(device=device, dtype=dtype)
    model.rope.to(dtype=torch.float32)  # cos/sin tables stay float32; cast per use
    bf16_kernel = linear_bf16_kernel(device, dtype, isa) if linear_kernel == "auto" else None
    if on_cpu and dtype == torch.bfloat16 and fma_min_rows != (None, None):  # the plan chose on this CPU
        use_fma_min_rows(*fma_min_rows)
    if model.is_last:  # before packing: the head keeps its own float32-output form
        model.lm_head = float32_logits_head(model.lm_head, bf16_kernel, isa)
    num_packed = 0
    if bf16_kernel is not None or can_pack(device, dtype):
        num_packed = pack_linear_layers(model, bf16_kernel)
    model.use_fused_ops(fused_ops(device, dtype, isa))
    model.use_layer_stack(LayerStack.build(model, isa or native_level()) if qlinear is not None else None)
    log.info(
        "model_slice_loaded",
        source=source,
        dtype=str(dtype),
        weight_format=weight_format,
        isa=isa,
        num_packed_linears=num_packed,
        linear_backend=_linear_backend(qlinear, bf16_kernel is not None, num_packed),
        weight_mb=round(model.weight_nbytes() / 2**20, 1),
        fused_ops=model.fused is not None,
        layer_stack=model.stack is not None,
        fma_min_rows=list(fma_min_rows),
        duration_s=round(time.perf_counter() - t0, 3),
    )
    return model


def _linear_backend(stored_kernel: NativeKernel | None, bf16_kernel: bool, num_packed: int) -> str:
    if stored_kernel is not None:
        return "qlinear" if stored_kernel.dtype == torch.float32 else "linear_bf16_blocks"
    return "linear_bf16" if bf16_kernel else "onednn" if num_packed else "torch"


def step_graph_sizes(config: EngineConfig, device: str) -> tuple[int, ...]:
    """The step sizes (tokens) a stage on `device` captures CUDA graphs for (none on CPU): every
    `model.cuda_graph_sizes` entry a step can reach (`scheduler.max_num_batched_tokens`), and the
    smallest one above it, so that every step up to that many tokens replays a graph."""
    if not (is_cuda(device) and config.model.cuda_graphs):
        return ()
    sizes, max_tokens = config.model.cuda_graph_sizes, config.scheduler.max_num_batched_tokens
    fitting = tuple(b for b in sizes if b < max_tokens)
    above = [b for b in sizes if b >= max_tokens]
    return fitting + tuple(above[:1])


def stage_num_blocks(arch: ModelArch, num_layers: int, budget_mb: int, block_size: int, dtype: torch.dtype) -> int:
    return num_blocks_for_budget(
        budget_mb * 1024 * 1024,
        block_size,
        num_layers,
        arch.num_kv_heads,
        arch.head_dim,
        dtype.itemsize,
    )


def build_runner(
    model: LlamaModel,
    *,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    dtype: torch.dtype,
    device: str,
    kv_connector: KVConnectorWorker | None = None,
    graph_sizes: tuple[int, ...] = (),
    max_model_len: int = 0,
    isa: str | None = None,
    pp_rank: int = 0,
    layer_range: tuple[int, int] | None = None,
    shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    speculative: SpeculativeConfig | None = None,
    grammars: Callable[[], GrammarCompiler] | None = None,
) -> ModelRunner:
    """With `graph_sizes`, the cache gets one more block, never handed out: decode graphs write
    their padding rows' K/V there. `shared_kv`: the caches of layers held with a neighbouring
    stage (global layer index -> (K, V), `parallel.shift_layers`); the others are allocated here.
    `layer_range`, `pp_rank`: see `ModelRunner`. `speculative`: the last stage gets its proposer.
    `grammars`: gives the last stage its grammar compiler the first time a request asks for
    structured output (`load_grammars`; None: such requests are refused at the engine)."""
    num_allocated = num_blocks + 1 if graph_sizes else num_blocks
    shared_kv = shared_kv or {}
    own = [i for i in range(model.start_layer, model.end_layer) if i not in shared_kv]
    allocated = iter(
        allocate_kv_caches(len(own), num_allocated, block_size, model.arch.num_kv_heads, model.arch.head_dim, dtype, device)
    )
    kv_caches = [shared_kv[i] if i in shared_kv else next(allocated) for i in range(model.start_layer, model.end_layer)]
    return ModelRunner(
        model,
        kv_caches,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        device=device,
        kv_connector=KVConnectorWrapper(kv_connector),
        graph_sizes=graph_sizes,
        max_model_len=max_model_len,
        pad_slot=num_blocks * block_size if graph_sizes else None,
        isa=isa,
        pp_rank=pp_rank,
        layer_range=layer_range,
        proposer=create_proposer(speculative) if speculative is not None and model.is_last else None,
        num_speculative_tokens=speculative.num_speculative_tokens if speculative is not None else 0,
        structured=StructuredSampling(grammars) if grammars is not None and model.is_last else None,
    )


def load_grammars(source: str, path: str | None, vocab_size: int) -> Callable[[], GrammarCompiler]:
    """A stage process's grammar compiler, on the model's tokenizer, loaded when first called (a process
    that holds the engine's tokenizer passes the engine's compiler instead)."""

    def make_compiler() -> GrammarCompiler:
        from asyncpp.structured.compiler import GrammarCompiler  # llguidance: only once a request needs it
        from asyncpp.tokenizer.loader import load_tokenizer

        return GrammarCompiler(load_tokenizer(source, path, vocab_size), vocab_size)

    return make_compiler
