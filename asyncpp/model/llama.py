"""A Llama-family decoder built as a slice of layers `[start_layer, end_layer)`.

Single-device, pure model code: the first slice embeds tokens, the last
applies the final norm and computes logits, every slice carries
`(hidden_states, residual)` between layers the way vLLM does (the residual
add is fused into the next norm's input), which computes exactly the same
sums as HF's `x + f(norm(x))` in the same order. A pipeline stage is one
slice; chaining slices gives bit-identical results to the whole model.

Weights arrive as HF-named tensors (see `asyncpp.weights`); q/k/v and
gate/up are concatenated at load time so each layer does 4 matmuls.
`use_fused_ops` swaps the elementwise code (add + norm, SiLU * up, RoPE)
for fused kernels with the same roundings (`asyncpp.kernels.fused_ops`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncpp.kernels.fused_ops import FusedOps
from asyncpp.kernels.layer_stack import LayerStack
from asyncpp.model.arch import ModelArch
from asyncpp.model.attention import AttentionMetadata, paged_attention
from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.model.native_linear import NativeWeights
from asyncpp.weights.base import StoredTensor


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused: FusedOps | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual, (norm(x), x)."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x if residual is None else residual + x
        # Normalise in float32 like HF, then scale in the activation dtype. torch's fused kernel
        # is bit-identical to HF's x * rsqrt(mean(x^2) + eps) in float32 (tested) and 3 ops, not 8.
        normed = F.rms_norm(residual.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype), residual


class RotaryEmbedding(nn.Module):
    """HF-convention RoPE (rotate-half), cos/sin tables computed once in float32."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_position, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype, fused: FusedOps | None) -> "StepRope":
        """The step's rotation: cos/sin looked up once, used by every layer."""
        if fused is not None:
            return StepRope(positions, (self.cos, self.sin), fused)
        cos_sin = (self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))
        return StepRope(positions, cos_sin, None)


class StepRope:
    """Rotates `[num_tokens, num_heads, head_dim]` q/k by one step's positions."""

    def __init__(
        self, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], fused: FusedOps | None
    ) -> None:
        # fused: the float32 [max_position, head_dim] tables; else the step's [num_tokens, 1, head_dim] rows.
        self.positions, self.cos_sin, self.fused = positions, cos_sin, fused

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The rotated `x`; the fused kernel rotates in place."""
        cos, sin = self.cos_sin
        if self.fused is not None:
            return self.fused.rope_(x, self.positions, cos, sin)
        return x * cos + _rotate_half(x) * sin

    def apply_writing_kv(
        self, qk: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """`apply(qk)` (q heads, then the k heads); where the fused ops can (`fuses_kv_write`), the rotated k
        and `v` are also written to their cache slots in the same launch. Returns (rotated qk, written)."""
        if self.fused is None or not self.fused.fuses_kv_write:
            return self.apply(qk), False
        cos, sin = self.cos_sin
        return self.fused.rope_write_kv_(qk, self.positions, cos, sin, v, kv_cache[0], kv_cache[1], slot_mapping), True


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent in the projection: rotate them in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        qk, kv_written = rope.apply_writing_kv(qk, v, kv_cache, meta.slot_mapping)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_written=kv_written)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.fused: FusedOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Layers `[start_layer, end_layer)` of a Llama decoder (global layer indices)."""

    def __init__(self, arch: ModelArch, start_layer: int = 0, end_layer: int | None = None) -> None:
        super().__init__()
        end_layer = arch.num_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= arch.num_layers:
            raise ValueError(f"bad layer slice [{start_layer}, {end_layer}) for {arch.num_layers} layers")
        self.arch = arch
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == arch.num_layers
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(start_layer, end_layer))
        self.rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta)
        if self.is_last:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.requires_grad_(False)
        self.fused: FusedOps | None = None
        self.stack: LayerStack | None = None

    def use_fused_ops(self, fused: FusedOps | None) -> None:
        """Run norms, SiLU * up and RoPE through `fused` (None: plain torch)."""
        self.fused = fused
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.fused = fused

    def use_layer_stack(self, stack: "LayerStack | None") -> None:
        """Run the decoder layers through `stack` (one C call, the same kernels) when a step's
        attention goes through the decode kernel; None: module by module."""
        self.stack = stack

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def weight_nbytes(self) -> int:
        """Bytes of weights this slice keeps resident: parameters, plus the packed weights of
        modules that hold them outside parameters (each counted once, however often shared)."""
        seen: set[int] = set()
        total = 0
        for module in self.modules():
            tensors = list(module.parameters(recurse=False)) + list(getattr(module, "packed_tensors", lambda: [])())
            for t in tensors:
                if t.is_mkldnn:  # oneDNN's opaque packed layout: no storage to look at
                    total += t.numel() * t.element_size()
                elif t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
        return total

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [num_tokens], first slice only
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) per layer of this slice
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the previous slice
        layer_range: tuple[int, int] | None = None,  # global [start, end) to run; None: every layer held
    ) -> IntermediateTensors | torch.Tensor:
        """Non-last slices return `IntermediateTensors`; the last returns normed hidden states.

        `layer_range` runs part of the layers held (`parallel.shift_layers`): the first slice
        must start at its first layer and the last end at its last, as they embed and
        project; `kv_caches` still has one entry per layer held."""
        first, last = self._local_range(layer_range)
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        if self.stack is not None and meta.kernel_rows is not None:
            hidden, residual = self.stack.forward(hidden, residual, positions, kv_caches[first:last], meta, first)
        else:
            rope = self.rope.for_step(positions, hidden.dtype, self.fused)
            for layer, kv_cache in zip(self.layers[first:last], kv_caches[first:last], strict=True):
                hidden, residual = layer(hidden, residual, rope, kv_cache, meta)
        if not self.is_last:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        return self.norm(hidden, residual)[0]

    def _local_range(self, layer_range: tuple[int, int] | None) -> tuple[int, int]:
        """`layer_range` as indices into `self.layers`, checked against what this slice may run."""
        if layer_range is None:
            return 0, self.num_layers
        start, end = layer_range
        ok = self.start_layer <= start < end <= self.end_layer
        ok = ok and (start == self.start_layer or not self.is_first) and (end == self.end_layer or not self.is_last)
        if not ok:
            raise ValueError(f"layers [{start}, {end}) cannot run on the slice [{self.start_layer}, {self.end_layer})")
        return start - self.start_layer, end - self.start_layer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.lm_head(hidden)

    def load_weights(self, tensors: dict[str, torch.Tensor | StoredTensor], native: NativeWeights | None = None) -> None:
        """Copy HF-named tensors in; every parameter of the slice must be covered.

        Weights given as `StoredTensor`s (the source's own format) replace their
        layer by one of `native`'s modules instead of being copied."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            param = params[name]
            if param.shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
            param.data.copy_(value)
            loaded.add(name)

        def get(name: str) -> torch.Tensor | StoredTensor:
            if name not in tensors:
                raise ValueError(f"missing weight tensor {name}")
            return tensors[name]

        def put_linear(module: str, parts: list[torch.Tensor | StoredTensor]) -> None:
            """`module`'s weight: the parts stacked by rows (q, k, v -> qkv)."""
            if not any(isinstance(p, StoredTensor) for p in parts):
                put(f"{module}.weight", parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
                return
            if native is None or not all(isinstance(p, StoredTensor) for p in parts):
                raise ValueError(f"{module}: stored-format weights need native modules, and all parts stored")
            expected = params[f"{module}.weight"].shape
            shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
            if tuple(expected) != shape:
                raise ValueError(f"weight {module}: expected shape {tuple(expected)}, got {shape}")
            self.set_submodule(module, native.linear(parts))
            loaded.add(f"{module}.weight")

        if self.is_first:
            embed = get("model.embed_tokens.weight")
            if isinstance(embed, StoredTensor):
                if native is None:
                    raise ValueError("embed_tokens: a stored-format weight needs native modules")
                self.embed_tokens = native.embedding(embed)
                loaded.add("embed_tokens.weight")
            else:
                put("embed_tokens.weight", embed)
        for local, layer_idx in enumerate(range(self.start_layer, self.end_layer)):
            src, dst = f"model.layers.{layer_idx}.", f"layers.{local}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{norm}.weight", get(f"{src}{norm}.weight"))
            put_linear(f"{dst}self_attn.qkv_proj", [get(f"{src}self_attn.{p}_proj.weight") for p in "qkv"])
            put_linear(f"{dst}self_attn.o_proj", [get(f"{src}self_attn.o_proj.weight")])
            put_linear(f"{dst}mlp.gate_up_proj", [get(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")])
            put_linear(f"{dst}mlp.down_proj", [get(f"{src}mlp.down_proj.weight")])
        if self.is_last:
            put("norm.weight", get("model.norm.weight"))
            put_linear("lm_head", [get("lm_head.weight")])
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"parameters not loaded: {sorted(missing)}")
