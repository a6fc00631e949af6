"""A model slice's decoder layers in one C call (`layer_stack.c`): the CPU fast path of native weights.

`LayerStack.build(model, isa)` returns a stack for a CPU `LlamaModel` whose
linears are all `StackableLinear` (the model's `NativeLinear`: float32 over
`qlinear`, or bfloat16 over GGUF blocks through `linear_bf16_q`) and whose
elementwise ops are fused, or None when some part is missing (another device,
no C compiler, a layer with more than `MAX_RUNS` weight formats, bfloat16 over
float-format weights). The stack calls the very kernels the modules call, in
the same order, so its output is bit-identical to the module-by-module forward
(tested); what it saves is the Python between them, about 0.1 ms per layer,
which on a one-request decode step is a quarter of the step.

The weight table is built once per KV cache (caches do not move); per step
only the token metadata, the activations and a scratch buffer travel.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch

from asyncpp.kernels.build import VEC_DTYPE_CODES, load_kernel_library
from asyncpp.kernels.fused_ops import FusedOps
from asyncpp.kernels.qlinear import BLOCK_FORMATS, FORMATS

MAX_RUNS = 4
# Activation dtype -> (library, function) of the linears: the same signature, (fmt, x, ldx, m, packed, n, k, y, ldy,
# threads) -> status, and the same format codes.
_LINEARS = {torch.float32: ("qlinear", "qlinear"), torch.bfloat16: ("linear_bf16", "linear_bf16_q")}
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


class _Linear(ctypes.Structure):
    _fields_ = [
        ("num_runs", _I64),
        ("in_features", _I64),
        ("formats", _I64 * MAX_RUNS),
        ("out_features", _I64 * MAX_RUNS),
        ("packed", _PTR * MAX_RUNS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("linear", _PTR),
        ("norm", _PTR),
        ("silu", _PTR),
        ("rope", _PTR),
        ("attention", _PTR),
        ("hidden", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("block_size", _I64),
        ("elem_bytes", _I64),
        ("dtype", _I64),
        ("eps", _F32),
        ("scale", _F32),
        ("cos_table", _PTR),
        ("sin_table", _PTR),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _I64),
        ("positions", _PTR),
        ("slot_mapping", _PTR),
        ("block_table", _PTR),
        ("block_table_stride", _I64),
        ("rows", _PTR),
        ("context_lens", _PTR),
        ("max_context_len", _I64),
    ]


# The model imports this module, so the stack names no model class: what it reads of the model's objects is
# spelled out here (`StackableLinear`, `StackModel`, `StepMeta`).
class StackModel(Protocol):
    """What the stack reads of a model slice (the model's `LlamaModel`): its arch's sizes, fused ops, RoPE
    tables, and per decoder layer the norms, the four linears and the attention scale."""

    arch: Any
    fused: FusedOps | None
    rope: Any
    layers: Any


class StepRows(Protocol):
    """The decode attention kernel's share of a step (the model's `_KernelRows`)."""

    rows: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int


class StepMeta(Protocol):
    """What the stack reads of a step's attention metadata (the model's `AttentionMetadata`)."""

    slot_mapping: torch.Tensor
    block_size: int

    @property
    def kernel_rows(self) -> StepRows | None: ...


class StackableLinear:
    """A linear the stack can run; the model's `NativeLinear` derives from it. The stack reads `runs`, (format,
    packed weight, out_features) per run of output columns, packed for `qlinear` / `linear_bf16_q`, and
    `in_features`."""

    runs: list[tuple[str, torch.Tensor, int]]
    in_features: int


TIME_KINDS = ("linears", "attention", "other")  # layer_stack.c's T_LINEAR, T_ATTENTION, T_OTHER


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class LayerStack:
    """Runs all decoder layers of one float32 model slice through `layer_stack_f32`."""

    def __init__(self, lib: ctypes.CDLL, model_struct: _Model, model: StackModel) -> None:
        self._lib = lib
        self._model_struct = model_struct
        self._model = model  # keeps the packed weights, norms and rope tables alive
        # Weight tables by (first layer, KV cache addresses): one per range of layers a step runs
        # (several with `parallel.shift_layers`); caches do not move, so they are built once.
        self._tables: dict[tuple[int, tuple[int, ...]], ctypes.Array] = {}
        arch = model.arch
        self.dtype = model.fused.dtype
        self._scratch_per_token = lib.stack_scratch_elems(1, arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size)

    @staticmethod
    def build(model: StackModel, isa: str) -> "LayerStack | None":
        fused = model.fused
        if fused is None or fused.dtype not in _LINEARS or model.rope.cos.device.type != "cpu":
            return None
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not linears or not all(isinstance(m, StackableLinear) and len(m.runs) <= MAX_RUNS for m in linears):
            return None
        if fused.dtype == torch.bfloat16 and any(fmt not in BLOCK_FORMATS for m in linears for fmt, _, _ in m.runs):
            return None  # linear_bf16_q serves GGUF blocks only
        linear_lib, linear_name = _LINEARS[fused.dtype]
        # linear_bf16 is built for avx512_bf16 whatever the level (only that level has its kernel).
        libs = {name: load_kernel_library(name, "avx512_bf16" if name == "linear_bf16" else isa)
                for name in ("layer_stack", linear_lib, "fused_ops", "decode_attention")}  # fmt: skip
        if any(lib is None for lib in libs.values()):
            return None
        lib = libs["layer_stack"]
        lib.stack_scratch_elems.argtypes, lib.stack_scratch_elems.restype = [_I64] * 5, _I64
        lib.layer_stack.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _INT, _PTR, _INT]
        lib.layer_stack.restype = _INT
        lib.layer_stack_set_timing.argtypes, lib.layer_stack_set_timing.restype = [_INT], None
        lib.layer_stack_times.argtypes, lib.layer_stack_times.restype = [_PTR], None
        arch = model.arch
        attn = model.layers[0].self_attn
        suffix = "f32" if fused.dtype == torch.float32 else "bf16"
        model_struct = _Model(
            linear=_fn(libs[linear_lib], linear_name),
            norm=_fn(libs["fused_ops"], f"add_rms_norm_{suffix}"),
            silu=_fn(libs["fused_ops"], f"silu_mul_{suffix}"),
            rope=_fn(libs["fused_ops"], f"rope_{suffix}"),
            attention=_fn(libs["decode_attention"], "decode_attention"),
            hidden=arch.hidden_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            intermediate=arch.intermediate_size,
            block_size=0,
            elem_bytes=fused.dtype.itemsize,
            dtype=VEC_DTYPE_CODES[fused.dtype],
            eps=model.layers[0].input_layernorm.eps,
            scale=attn.scale,
            cos_table=model.rope.cos.data_ptr(),
            sin_table=model.rope.sin.data_ptr(),
        )
        return LayerStack(lib, model_struct, model)

    def set_timing(self, on: bool) -> None:
        """Count where this process's layer stacks spend their time (off by default: two clock reads
        per kernel call when on)."""
        self._lib.layer_stack_set_timing(int(on))

    def take_times(self) -> dict[str, float]:
        """Seconds in the linears, the attention and the rest (norms, RoPE, KV writes, SiLU * up) since
        the last call, summed over this process's layer stacks; the counts start again at zero."""
        ns = (ctypes.c_int64 * len(TIME_KINDS))()
        self._lib.layer_stack_times(ns)
        return {kind: n / 1e9 for kind, n in zip(TIME_KINDS, ns)}

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], first: int) -> ctypes.Array:
        """The table of the slice's layers [first, first + len(kv_caches))."""
        key = (first, tuple(k.data_ptr() for k, _ in kv_caches))
        table = self._tables.get(key)
        if table is None:
            table = (_Layer * len(kv_caches))()
            layers = self._model.layers[first : first + len(kv_caches)]
            for entry, layer, (k_cache, v_cache) in zip(table, layers, kv_caches, strict=True):
                if k_cache.dtype != self.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                    raise ValueError(f"the layer stack needs contiguous {self.dtype} KV caches")
                entry.input_norm = layer.input_layernorm.weight.data_ptr()
                entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
                for field, module in (
                    ("qkv", layer.self_attn.qkv_proj),
                    ("o", layer.self_attn.o_proj),
                    ("gate_up", layer.mlp.gate_up_proj),
                    ("down", layer.mlp.down_proj),
                ):
                    target = getattr(entry, field)
                    target.num_runs, target.in_features = len(module.runs), module.in_features
                    for i, (fmt, packed, n) in enumerate(module.runs):
                        target.formats[i], target.out_features[i], target.packed[i] = FORMATS[fmt], n, packed.data_ptr()
                entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            self._tables[key] = table
        return table

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] in the stack's dtype
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None: first layer of the model
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # of the layers run
        meta: StepMeta,
        first: int = 0,  # the slice's index of the first layer run
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kd = meta.kernel_rows
        if kd is None:
            raise ValueError("the layer stack needs the decode attention kernel's metadata")
        num_tokens = hidden.shape[0]
        # Fresh copies: the inputs may be a ring slot or a tensor the caller keeps (a few us).
        hidden = hidden.to(self.dtype, copy=True).contiguous()
        has_residual = residual is not None
        residual = residual.to(self.dtype, copy=True).contiguous() if has_residual else torch.empty_like(hidden)
        self._model_struct.block_size = meta.block_size
        positions = positions.contiguous()
        step = _Step(
            num_tokens=num_tokens,
            positions=positions.data_ptr(),
            slot_mapping=meta.slot_mapping.data_ptr(),
            block_table=kd.block_table.data_ptr(),
            block_table_stride=kd.block_table.stride(0),
            rows=kd.rows.data_ptr(),
            context_lens=kd.context_lens.data_ptr(),
            max_context_len=kd.max_context_len,
        )
        scratch = torch.empty(num_tokens * self._scratch_per_token, dtype=self.dtype)
        status = self._lib.layer_stack(
            ctypes.byref(self._model_struct), self._layer_table(kv_caches, first), len(kv_caches), ctypes.byref(step),
            hidden.data_ptr(), residual.data_ptr(), int(has_residual), scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"layer stack failed with status {status}")
        return hidden, residual
