"""Fused bfloat16 ops against the torch code they replace in the model, at every ISA level the CPU runs;
the float32 ops are in test_fused_ops_f32.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncpp.kernels.fused_ops import fused_ops
from asyncpp.kernels.isa import cpu_info
from asyncpp.model.arch import ModelArch
from asyncpp.model.llama import MLP, RMSNorm, RotaryEmbedding

BF16 = torch.bfloat16
LEVELS = [level for level in cpu_info().supported_levels if level != "amx"]  # amx builds like avx512_bf16


@pytest.fixture(scope="module", params=LEVELS)
def ops(request):
    fused = fused_ops("cpu", BF16, request.param)
    if fused is None:
        pytest.skip("no C compiler: fused ops unavailable")
    return fused


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bfloat16 units in the last place (same-sign values)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def test_bfloat16_and_float32_on_cpu_are_fused():
    for dtype in (BF16, torch.float32):
        fused = fused_ops("cpu", dtype)
        assert fused is None or fused.dtype == dtype  # None only without a C compiler
    assert fused_ops("cpu", torch.float16) is None
    assert fused_ops("meta", BF16) is None
    assert fused_ops("meta", torch.float32) is None


def test_a_tensor_of_another_dtype_is_a_type_error(ops):
    x = torch.randn(2, 8)
    with pytest.raises(TypeError):
        ops.add_rms_norm(x, None, torch.ones(8, dtype=BF16), 1e-5)
    with pytest.raises(TypeError):
        ops.add_rms_norm(x.to(BF16), None, torch.ones(8), 1e-5)
    with pytest.raises(TypeError):
        ops.silu_mul(x)
    with pytest.raises(TypeError):
        ops.rope_(x.view(2, 1, 8), torch.zeros(2, dtype=torch.int64), torch.ones(4, 8), torch.ones(4, 8))


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(ops, num_tokens, with_residual):
    g = torch.Generator().manual_seed(num_tokens)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(576, generator=g)).to(BF16)
    x = (3 * torch.randn(num_tokens, 576, generator=g)).to(BF16)
    residual = torch.randn(num_tokens, 576, generator=g).to(BF16) if with_residual else None
    x_before = x.clone()
    ref_out, ref_residual = norm(x, residual)
    out, new_residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(new_residual, ref_residual)  # one rounding of the same float sum
    assert torch.equal(x, x_before), "inputs must not be modified"
    # Only the order of the float32 sum of squares differs, so the normalised value (rounded to
    # bfloat16 before the weight scale, as torch does) is at most one bfloat16 step from torch's;
    # the weight product can stretch that step to two in the output, so check it before the scale.
    normed = F.rms_norm(new_residual.float(), norm.weight.shape, eps=norm.eps).to(BF16)
    neighbours = [(normed.view(torch.int16) + step).view(BF16) for step in (-1, 0, 1)]
    matches = torch.stack([out == norm.weight * n for n in neighbours])
    assert matches.any(dim=0).all(), "the kernel's normalised value is more than one bfloat16 step off"
    assert matches[1].float().mean() > 0.99
    assert _bf16_ulps(out, ref_out) <= 2


def test_silu_mul_is_the_same_at_every_level():
    # Below AVX-512 silu_mul runs a vector-type version of the loop AVX-512 builds vectorise themselves.
    kernels = [k for k in (fused_ops("cpu", BF16, level) for level in LEVELS) if k is not None]
    if len(kernels) < 2:
        pytest.skip("one ISA level (or no C compiler) here")
    g = torch.Generator().manual_seed(3)
    gate_up = (30 * torch.randn(37, 2 * 300, generator=g)).to(BF16)  # |x| past the exp clamp (87) too
    gate_up[0, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e30, -1e30, 1e-30, -1e-30]).to(BF16)
    first = kernels[0].silu_mul(gate_up)
    for k in kernels[1:]:
        assert torch.equal(k.silu_mul(gate_up).view(torch.int16), first.view(torch.int16))


def _narrow(f: np.ndarray) -> np.ndarray:
    """cpu_math.h's narrow(): float32 -> bfloat16 bits, nearest with ties to even (no NaN here)."""
    u = f.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _silu_reference(x: np.ndarray) -> np.ndarray:
    """cpu_math.h's silu in float32, operation for operation (exp_nonpositive(-|x|), its Cephes polynomial)."""
    f = np.float32
    a = np.minimum(np.abs(x), f(87.0))  # exp_nonpositive's clamp of -|x| at -87
    n = np.rint(-a * f(1.44269504088896341))
    r = (-a - n * f(0.693145751953125)) - n * f(1.428606765330187e-06)
    p = f(1.9875691500e-4) * r + f(1.3981999507e-3)
    for c in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = ((p * r) * r + r) + f(1.0)
    t = p * ((n.astype(np.int32) + 127) << 23).view(np.float32)
    return x * (np.where(x >= 0, f(1.0), t) / (f(1.0) + t))


def test_silu_mul_gives_the_formula_s_bits_for_every_bfloat16_gate(ops):
    """silu_mul looks its gates up in a table: every one of the 65536 gates (times up = 1) must give
    bf16(silu(gate)) exactly as cpu_math.h computes it; NaN gates give a NaN."""
    gates = torch.from_numpy(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16)).view(BF16).reshape(256, 256)
    out = ops.silu_mul(torch.cat([gates, torch.ones_like(gates)], dim=1)).view(torch.int16).numpy().view(np.uint16)
    x = gates.float().numpy().ravel()
    is_nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = _narrow(_silu_reference(x))
    assert np.array_equal(out.ravel()[~is_nan], expected[~is_nan])
    assert torch.isnan(torch.from_numpy(out.ravel()[is_nan].view(np.int16)).view(BF16).float()).all()


@pytest.mark.parametrize("num_tokens", [1, 64, 257])
@pytest.mark.parametrize("inter", [96, 100, 300])  # 100: a partial vector of 4 at the end of each row; 300: 256 + 44
def test_silu_mul_matches_torch(ops, num_tokens, inter):
    arch = ModelArch(
        vocab_size=10, hidden_size=32, intermediate_size=inter, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    mlp = MLP(arch)
    g = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(num_tokens, 2 * inter, generator=g)).to(BF16)
    gate, up = gate_up.split(inter, dim=-1)
    ref = F.silu(gate) * up
    out = ops.silu_mul(gate_up)
    assert out.shape == ref.shape
    assert _bf16_ulps(out, ref) <= 1  # expf vs torch's vectorised exp, then identical roundings
    assert (out == ref).float().mean() > 0.99
    mlp.to(BF16)  # the module path uses the same op
    mlp.fused = ops
    x = torch.randn(num_tokens, 32, generator=g).to(BF16)
    fused_out = mlp(x)
    mlp.fused = None
    assert _bf16_ulps(fused_out, mlp(x)) <= 2


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_matches_torch_in_place(ops, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (37,), generator=g)
    # A strided view like the model's: q and k heads of a wider qkv projection.
    qkv = torch.randn(37, 5 * head_dim, generator=g).to(BF16)
    qk = qkv[:, : 4 * head_dim].view(37, 4, head_dim)
    ref = rope.for_step(positions, BF16, None).apply(qk.clone())
    v_before = qkv[:, 4 * head_dim :].clone()
    out = rope.for_step(positions, BF16, ops).apply(qk)
    assert out.data_ptr() == qk.data_ptr()
    assert torch.equal(out, ref)
    assert torch.equal(qkv[:, 4 * head_dim :], v_before), "v must be left alone"


def test_rope_takes_each_half_of_the_tables_as_given(ops):
    """A model's cos and sin repeat across the two halves of a head; the op must not rely on it: with
    random tables it still equals torch's x * cos + rotate_half(x) * sin in bfloat16."""
    g = torch.Generator().manual_seed(5)
    head_dim, half = 64, 32
    cos, sin = torch.randn(50, head_dim, generator=g), torch.randn(50, head_dim, generator=g)
    positions = torch.randint(0, 50, (9,), generator=g)
    x = torch.randn(9, 3, head_dim, generator=g).to(BF16)
    c, s = cos[positions].to(BF16)[:, None, :], sin[positions].to(BF16)[:, None, :]
    ref = x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s
    assert torch.equal(ops.rope_(x.clone(), positions, cos, sin), ref)
