"""A/B of the Triton fused elementwise ops on CUDA: SmolLM2-135M's shape, random weights, bfloat16.

`python3 scripts/fused_ab.py` (from the project root, a CUDA GPU required) times a
decode step of 1, 64 and 256 tokens through every decoder layer and the final
norm, with the torch elementwise code (`use_fused_ops(None)`) and with the Triton
ops, eagerly and as one CUDA graph replay (median of many), and prints ms per
step, the ratio and how far the outputs of the two are apart. Attention itself is
left out: each layer runs its norms, qkv projection, RoPE, o_proj (on the rotated
q, a stand-in for attention's output) and MLP, the part the fused ops change.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python3 scripts/fused_ab.py` from anywhere
from asyncpp.kernels.triton_fused import triton_fused_ops
from asyncpp.model.llama import LlamaModel
from asyncpp.weights import read_arch

BATCHES = (1, 64, 256)
EAGER_ITERS, GRAPH_REPLAYS = 20, 200


def build_model() -> LlamaModel:
    arch = read_arch("random", "smollm2-135m")
    torch.manual_seed(0)
    model = LlamaModel(arch)
    for layer in model.layers:  # norm weights away from 1, like trained ones
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.normal_(1.0, 0.2)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    model.rope.to(dtype=torch.float32)  # cos/sin tables stay float32, like the engine's
    return model


def step(model: LlamaModel, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Every layer without attention, then the final norm (`DecoderLayer.forward`'s other parts)."""
    residual = None
    rope = model.rope.for_step(positions, hidden.dtype, model.fused)
    for layer in model.layers:
        attn = layer.self_attn
        hidden, residual = layer.input_layernorm(hidden, residual)
        qkv = attn.qkv_proj(hidden)
        qk = qkv[:, : attn.q_size + attn.kv_size].view(-1, attn.num_heads + attn.num_kv_heads, attn.head_dim)
        qk = rope.apply(qk)
        hidden = attn.o_proj(qk[:, : attn.num_heads].reshape(-1, attn.q_size))
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    return model.norm(hidden, residual)[0]


def time_eager(model: LlamaModel, hidden: torch.Tensor, positions: torch.Tensor) -> float:
    """Median ms of one step over several runs of `EAGER_ITERS` back-to-back steps."""
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(EAGER_ITERS):
            step(model, hidden, positions)
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / EAGER_ITERS)
    return statistics.median(runs)


def time_graph(model: LlamaModel, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Median ms of one replay of the step captured as one CUDA graph, and the graph's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            step(model, hidden, positions)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(model, hidden, positions)
    times = []
    for _ in range(GRAPH_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out.clone()


def main() -> int:
    if not torch.cuda.is_available():
        print("fused_ab: needs a CUDA device", file=sys.stderr)
        return 1
    fused = triton_fused_ops("cuda", torch.bfloat16)
    if fused is None:
        print("fused_ab: Triton is not installed", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    model = build_model()
    arch = model.arch
    print(f"SmolLM2-135M shape, {arch.num_layers} layers, bfloat16, random weights, {torch.cuda.get_device_name()}")
    print("per step: every layer's norms, qkv, RoPE, o_proj, MLP and the final norm; attention NOT included\n")
    print(f"{'tokens':>6} | {'mode':>5} | {'torch ms':>8} | {'fused ms':>8} | {'ratio':>5} | max |diff| | identical")
    for num_tokens in BATCHES:
        g = torch.Generator(device="cuda").manual_seed(num_tokens)
        hidden = torch.randn(num_tokens, arch.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        positions = torch.randint(0, 2048, (num_tokens,), generator=g, device="cuda")
        results = {}
        for name, ops in (("torch", None), ("fused", fused)):
            model.use_fused_ops(ops)
            eager_out = step(model, hidden, positions)
            eager = time_eager(model, hidden, positions)
            graph, graph_out = time_graph(model, hidden, positions)
            if not torch.equal(graph_out, eager_out):
                print(f"  note: {name}'s graph replay is not bit-identical to its eager step ({num_tokens} tokens)")
            results[name] = (eager, graph, eager_out.float())
        diff = (results["torch"][2] - results["fused"][2]).abs()
        same = float((diff == 0).float().mean())
        for i, mode in ((0, "eager"), (1, "graph")):
            t, f = results["torch"][i], results["fused"][i]
            print(f"{num_tokens:>6} | {mode:>5} | {t:8.3f} | {f:8.3f} | {f / t:5.2f} | {diff.max():10.4g} | {same:8.1%}")
    model.use_fused_ops(None)
    print(f"\n{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        raise SystemExit(main())
