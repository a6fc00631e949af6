"""Fused float32 ops at every ISA level the CPU runs: against a float64 reference, against the torch
float32 code they replace in the model (RoPE and the residual add bit-identical to it), row-wise."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from asyncpp.kernels.fused_ops import fused_ops
from asyncpp.kernels.isa import cpu_info
from asyncpp.model.arch import ModelArch
from asyncpp.model.llama import MLP, RMSNorm, RotaryEmbedding, _rotate_half

F32 = torch.float32
LEVELS = [level for level in cpu_info().supported_levels if level != "amx"]  # amx builds like avx512_bf16
NUM_TOKENS = [1, 7, 64, 512]
EPS = 1e-5
EPS_F32 = float(torch.tensor(EPS, dtype=F32))  # the kernel takes eps as a float32
U = 2.0**-24  # float32 unit roundoff: one rounding's largest relative error


@pytest.fixture(scope="module", params=LEVELS)
def ops(request):
    fused = fused_ops("cpu", F32, request.param)
    if fused is None:
        pytest.skip("no C compiler: fused ops unavailable")
    assert fused.dtype == F32
    return fused


@contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest relative error; an exact zero must come out as zero (randn does draw 0.0 now and then)."""
    err = (out.double() - exact).abs() / exact.abs()
    return float(torch.where(exact == 0, (out != 0).double(), err).max())


def _rms_inputs(num_tokens: int, hidden: int, with_residual: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = 1 + 0.3 * torch.randn(hidden, generator=g)
    x = 3 * torch.randn(num_tokens, hidden, generator=g)
    residual = torch.randn(num_tokens, hidden, generator=g) if with_residual else None
    return x, residual, weight


def _rope_inputs(num_tokens: int, head_dim: int, seed: int):
    """q/k heads of a wider qkv projection, like the model's: `[num_tokens, 4, head_dim]` strided."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 5 * head_dim, generator=g)
    positions = torch.randint(0, 512, (num_tokens,), generator=g)
    return qkv, qkv[:, : 4 * head_dim].view(num_tokens, 4, head_dim), positions


@pytest.mark.parametrize("hidden", [576, 7, 1001])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(ops, num_tokens, hidden, with_residual):
    x, residual, weight = _rms_inputs(num_tokens, hidden, with_residual, seed=num_tokens * 4096 + hidden)
    inputs_before = [t.clone() for t in (x, residual, weight) if t is not None]
    out, new_residual = ops.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, x if residual is None else x + residual)
    assert all(torch.equal(t, b) for t, b in zip([t for t in (x, residual, weight) if t is not None], inputs_before))
    r = new_residual.double()
    exact = weight.double() * r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + EPS_F32)
    # 1 / rms rounded once from a double sum, then r * inv_rms and weight * (...): three roundings.
    assert _rel_err(out, exact) <= 3.01 * U
    # torch's float32 sum of squares, mean and vectorised rsqrt are a few roundings off themselves
    # (up to ~4 ulps from the exact result), so it is only as close as both errors allow.
    torch.testing.assert_close(out, F.rms_norm(new_residual, (hidden,), eps=EPS) * weight, rtol=6e-7, atol=0)


def test_add_rms_norm_sums_squares_without_overflow(ops):
    x, residual, weight = _rms_inputs(16, 576, True, seed=1)
    x, residual = x * 1e22, residual * 1e22  # squares overflow float32, not the double sum
    out, r = ops.add_rms_norm(x, residual, weight, EPS)
    exact = weight.double() * r.double() / torch.sqrt(r.double().pow(2).mean(-1, keepdim=True))
    assert _rel_err(out, exact) <= 3.01 * U


@pytest.mark.parametrize("inter", [1536, 7, 33])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_mul(ops, num_tokens, inter):
    g = torch.Generator().manual_seed(num_tokens * 4096 + inter)
    gate_up = 4 * torch.randn(num_tokens, 2 * inter, generator=g)
    gate, up = gate_up.split(inter, dim=-1)
    out = ops.silu_mul(gate_up)
    assert out.shape == (num_tokens, inter)
    assert _rel_err(out, F.silu(gate.double()) * up.double()) <= 1e-6
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=0)


def test_silu_mul_over_the_whole_range(ops):
    gate = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0])])
    out = ops.silu_mul(torch.stack([gate, torch.ones_like(gate)]).view(1, -1))[0]
    exact = F.silu(gate.double())
    normal = gate.abs() <= 80  # silu(-80) ~ -1.4e-33 is still a normal float32
    assert _rel_err(out[normal & (gate != 0)], exact[normal & (gate != 0)]) <= 1e-6
    assert (out[gate == 0] == 0).all()
    assert out[~normal].sub(exact[~normal]).abs().max() <= 1e-34  # exp's argument is clamped at -87


@pytest.mark.parametrize("head_dim", [6, 16, 64, 128])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rope_is_torch_bit_for_bit(ops, num_tokens, head_dim):
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    qkv, qk, positions = _rope_inputs(num_tokens, head_dim, seed=num_tokens * 4096 + head_dim)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    ref = qk * cos + _rotate_half(qk) * sin
    x_cos, rot_sin = qk.double() * cos.double(), _rotate_half(qk.double()) * sin.double()
    v_before = qkv[:, 4 * head_dim :].clone()
    out = ops.rope_(qk, positions, rope.cos, rope.sin)
    assert out.data_ptr() == qk.data_ptr()
    assert torch.equal(out, ref)
    assert torch.equal(qkv[:, 4 * head_dim :], v_before), "v must be left alone"
    # Two rounded products and their rounded sum.
    assert ((out.double() - (x_cos + rot_sin)).abs() <= 2.01 * U * (x_cos.abs() + rot_sin.abs())).all()


def test_rows_do_not_depend_on_the_batch(ops):
    """A row's result is the same alone, in a prefix of the batch, or in 512 rows over a thread team."""
    x, residual, weight = _rms_inputs(512, 577, True, seed=2)
    gate_up = 4 * torch.randn(512, 2 * 33, generator=torch.Generator().manual_seed(3))
    _, qk, positions = _rope_inputs(512, 64, seed=4)
    cos, sin = RotaryEmbedding(64, 512, 10000.0).cos, RotaryEmbedding(64, 512, 10000.0).sin

    def run(rows: slice) -> list[torch.Tensor]:
        norm = ops.add_rms_norm(x[rows], residual[rows], weight, EPS)
        return [*norm, ops.silu_mul(gate_up[rows]), ops.rope_(qk[rows].clone(), positions[rows], cos, sin)]

    with num_threads(2):
        full = run(slice(None))
    for rows in [slice(0, 1), slice(0, 7), slice(0, 64), slice(100, 101), slice(511, 512), slice(200, 263)]:
        for got, want in zip(run(rows), full):
            assert torch.equal(got, want[rows])


def test_zero_rows(ops):
    out, residual = ops.add_rms_norm(torch.empty(0, 7), torch.empty(0, 7), torch.ones(7), EPS)
    assert out.shape == residual.shape == (0, 7)
    assert ops.silu_mul(torch.empty(0, 14)).shape == (0, 7)
    rope = RotaryEmbedding(16, 8, 10000.0)
    x = torch.empty(0, 3, 16)
    assert ops.rope_(x, torch.empty(0, dtype=torch.int64), rope.cos, rope.sin) is x


def test_model_modules_take_float32_ops(ops):
    arch = ModelArch(
        vocab_size=10, hidden_size=32, intermediate_size=96, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    x, residual = torch.randn(9, 32, generator=g), torch.randn(9, 32, generator=g)
    norm, mlp, rope = RMSNorm(32, 1e-5), MLP(arch), RotaryEmbedding(16, 64, 1e4)
    norm.weight.data = 1 + 0.3 * torch.randn(32, generator=g)
    ref_out, ref_residual = norm(x, residual)
    ref_mlp = mlp(x)
    positions = torch.randint(0, 64, (9,), generator=g)
    qk = torch.randn(9, 3, 16, generator=g)
    ref_rope = rope.for_step(positions, F32, None).apply(qk.clone())
    norm.fused = mlp.fused = ops
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, rtol=6e-7, atol=0)
    torch.testing.assert_close(mlp(x), ref_mlp, rtol=1e-5, atol=1e-6)
    assert torch.equal(rope.for_step(positions, F32, ops).apply(qk), ref_rope)
