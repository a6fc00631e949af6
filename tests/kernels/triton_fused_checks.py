"""Checks of the Triton fused ops, run on CUDA in-process or on CPU under Triton's interpreter.

`python -m tests.kernels.triton_fused_checks` (with `TRITON_INTERPRET=1`) runs
every check on CPU and exits non-zero on the first failure; on a GPU
`tests/kernels/test_triton_fused.py` calls the same functions on CUDA. The
reference is the unfused torch code of the model's own modules (`RMSNorm`,
`MLP`, `RotaryEmbedding` with `fused=None`) on the same device, and float64.
Each check prints how many outputs differ from torch's, in units in the last
place of the dtype: bit-exact is the aim, one unit where torch's own float32
sum of squares, rsqrt or exp rounds differently is the limit.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F

from asyncpp.kernels.triton_fused import triton_fused_ops
from asyncpp.model.arch import ModelArch
from asyncpp.model.attention import AttentionMetadata
from asyncpp.model.llama import MLP, Attention, RMSNorm, RotaryEmbedding, _rotate_half
from tests.kernels.interpreted import main

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = (F32, BF16, F16)
U = {F32: 2.0**-24, BF16: 2.0**-8, F16: 2.0**-11}  # unit roundoff: one rounding's largest relative error
TINY = {F32: 2.0**-149, BF16: 2.0**-133, F16: 2.0**-24}  # the smallest subnormal
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M
EPS = 1e-5
EPS_F32 = float(torch.tensor(EPS, dtype=F32))
NUM_TOKENS = (1, 3, 17)
MAX_POSITION = 8192


def _ops(device: str, dtype: torch.dtype):
    ops = triton_fused_ops(device, dtype)
    assert ops is not None and ops.dtype == dtype, "Triton fused ops unavailable"
    return ops


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place of the dtype (same-sign values; float32 via its bits)."""
    if a.numel() == 0:
        return 0
    ints = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}[a.dtype]
    ia, ib = a.cpu().view(ints).long(), b.cpu().view(ints).long()
    return int((ia - ib).abs().max())


def _report(name: str, got: torch.Tensor, want: torch.Tensor) -> int:
    ulps = _ulps(got, want)
    differ = int((got.cpu() != want.cpu()).sum())
    print(f"  {name} {str(got.dtype)[6:]}: {differ}/{got.numel()} differ from torch, at most {ulps} ulp", flush=True)
    return ulps


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest relative error against a float64 `exact`; an exact zero must come out as zero.
    Results the dtype holds only as subnormals (float16's below 6e-5) count one subnormal step as exact."""
    tiny = TINY[out.dtype]
    out, exact = out.cpu().double(), exact.cpu()
    err = ((out - exact).abs() - 2 * tiny).clamp(min=0) / exact.abs()
    return float(torch.where(exact == 0, (out != 0).double(), err).max())


def _arch() -> ModelArch:
    return ModelArch(
        vocab_size=10, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITION,
    )  # fmt: skip


def check_add_rms_norm(device: str) -> None:
    """Against `RMSNorm` (unfused) and float64; the residual add bit-exact, no input modified."""
    for dtype in DTYPES:
        ops = _ops(device, dtype)
        norm = RMSNorm(HIDDEN, EPS)
        norm.weight.data = (1 + 0.3 * torch.randn(HIDDEN, generator=_gen(1))).to(device, dtype)
        worst = 0
        for num_tokens in NUM_TOKENS:
            for with_residual in (False, True):
                g = _gen(num_tokens * 2 + with_residual)
                x = (3 * torch.randn(num_tokens, HIDDEN, generator=g)).to(device, dtype)
                residual = torch.randn(num_tokens, HIDDEN, generator=g).to(device, dtype) if with_residual else None
                before = [t.clone() for t in (x, residual, norm.weight) if t is not None]
                norm.fused = None
                ref_out, ref_residual = norm(x, residual)
                norm.fused = ops
                out, new_residual = norm(x, residual)
                after = [t for t in (x, residual, norm.weight) if t is not None]
                assert all(torch.equal(a, b) for a, b in zip(after, before)), "inputs must not be modified"
                assert torch.equal(new_residual, ref_residual), "the residual add is one rounding, like torch's"
                assert new_residual.data_ptr() not in (x.data_ptr(), 0 if residual is None else residual.data_ptr())
                worst = max(worst, _report(f"add_rms_norm n={num_tokens} residual={with_residual}", out, ref_out))
                r = new_residual.cpu().double()
                exact = norm.weight.cpu().double() * r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + EPS_F32)
                # float32: 1 / rms rounded once, then two products; narrower: the normalised value and the
                # product rounded to the dtype (their float32 roundings are far below its ulp).
                bound = 3.01 * U[F32] if dtype == F32 else 2.01 * U[dtype] + 4 * U[F32]
                assert _rel_err(out, exact) <= bound, (dtype, num_tokens)
                if dtype == F32:  # torch's float32 sum of squares and rsqrt are a few roundings off
                    torch.testing.assert_close(out, ref_out, rtol=6e-7, atol=0)
        # Narrower dtypes: only where torch's float32 normalised value lands on the other side of a
        # rounding boundary can the two differ, by one step, stretched to two at most by the weight.
        assert worst <= (8 if dtype == F32 else 2), (dtype, worst)


def check_silu_mul(device: str) -> None:
    """Against `MLP`'s unfused SiLU * up and float64; the input is not modified."""
    for dtype in DTYPES:
        ops = _ops(device, dtype)
        for num_tokens in NUM_TOKENS:
            gate_up = (4 * torch.randn(num_tokens, 2 * INTER, generator=_gen(num_tokens))).to(device, dtype)
            before = gate_up.clone()
            gate, up = gate_up.split(INTER, dim=-1)
            ref = F.silu(gate) * up
            out = ops.silu_mul(gate_up)
            assert torch.equal(gate_up, before), "inputs must not be modified"
            assert out.shape == (num_tokens, INTER)
            ulps = _report(f"silu_mul n={num_tokens}", out, ref)
            exact = F.silu(gate.cpu().double()) * up.cpu().double()
            if dtype == F32:
                assert _rel_err(out, exact) <= 1e-6
                torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
            else:  # silu rounded to the dtype, then the product: two roundings
                assert _rel_err(out, exact) <= 2.01 * U[dtype] + 4 * U[F32]
                # silu one step off where float32 exp rounds differently near a midpoint, stretched
                # to two steps by the product at most (float16 on CPU: numpy's expf against torch's).
                assert ulps <= 2, (dtype, ulps)
    mlp = MLP(_arch()).to(device, BF16)  # the module path
    x = torch.randn(5, HIDDEN, generator=_gen(9)).to(device, BF16)
    ref = mlp(x)
    mlp.fused = _ops(device, BF16)
    _report("MLP(x)", mlp(x), ref)


def check_silu_over_the_whole_range(device: str) -> None:
    gate = torch.cat([torch.linspace(-100, 100, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0])])
    out = _ops(device, F32).silu_mul(torch.stack([gate, torch.ones_like(gate)]).view(1, -1).to(device))[0]
    exact = F.silu(gate.double())
    normal = (gate.abs() <= 80) & (gate != 0)  # silu(-80) ~ -1.4e-33 is still a normal float32
    assert _rel_err(out[normal], exact[normal]) <= 1e-6
    assert (out.cpu()[gate == 0] == 0).all()
    assert out.cpu()[~normal].double().sub(exact[~normal]).abs().max() <= 1e-34


def _rope_case(device: str, dtype: torch.dtype, num_tokens: int, seed: int):
    """A wider qkv buffer of 2 + num_tokens + 2 rows, v and a padding column poisoned, and the q/k view of
    the middle rows the way `Attention.forward` takes it; positions spread over the table, both ends included."""
    g = _gen(seed)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM + 8
    qkv = torch.randn(num_tokens + 4, width, generator=g).to(dtype)
    qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :] = float("nan")
    qkv = qkv.to(device)
    qk = qkv[2 : 2 + num_tokens, : (HEADS + KV_HEADS) * HEAD_DIM].view(-1, HEADS + KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=g)
    positions[0] = MAX_POSITION - 1
    if num_tokens > 1:
        positions[1] = 0
    return qkv, qk, positions.to(device)


def check_rope(device: str) -> None:
    """Bit-exact against `StepRope`'s unfused code for every dtype, in place on a strided view, writing
    nothing but its own rows and heads; against float64 within the roundings the torch code makes."""
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, 100000.0).to(device)
    for dtype in DTYPES:
        ops = _ops(device, dtype)
        for num_tokens in NUM_TOKENS:
            qkv, qk, positions = _rope_case(device, dtype, num_tokens, seed=num_tokens)
            assert num_tokens == 1 or qk.stride(0) != qk.shape[1] * HEAD_DIM  # rows strided
            before = qkv.clone()
            ref = rope.for_step(positions, dtype, None).apply(qk.clone())
            out = rope.for_step(positions, dtype, ops).apply(qk)
            assert out.data_ptr() == qk.data_ptr()
            _report(f"rope n={num_tokens}", out, ref)
            assert torch.equal(out, ref)
            mine = torch.zeros_like(qkv, dtype=torch.bool)
            mine[2 : 2 + num_tokens, : (HEADS + KV_HEADS) * HEAD_DIM] = True
            bits = {F32: torch.int32}.get(dtype, torch.int16)
            assert torch.equal(qkv.view(bits)[~mine], before.view(bits)[~mine]), "wrote outside its rows/heads"
            x = before[2 : 2 + num_tokens, : (HEADS + KV_HEADS) * HEAD_DIM].view_as(qk).cpu().double()
            cos, sin = rope.cos[positions].cpu().double()[:, None], rope.sin[positions].cpu().double()[:, None]
            x_cos, rot_sin = x * cos, _rotate_half(x) * sin
            # float32: two rounded products and their rounded sum; narrower: cos/sin rounded first too.
            bound = 2.01 * U[F32] if dtype == F32 else 3.01 * U[dtype] + 4 * U[F32]
            err = (out.cpu().double() - (x_cos + rot_sin)).abs()
            assert (err <= bound * (x_cos.abs() + rot_sin.abs()) + 3 * TINY[dtype]).all(), dtype


def check_rope_write_kv(device: str) -> None:
    """RoPE and the KV-cache write in one launch, as `Attention.forward` calls it: q/k rotated exactly as
    `rope_` (the unfused code's bits), and the caches equal to `index_copy_` of the rotated k and of v into
    their slots, nothing else in them touched; the other heads and rows of the qkv buffer untouched."""
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, 100000.0).to(device)
    num_slots = 40
    for dtype in DTYPES:
        ops = _ops(device, dtype)
        for num_tokens in NUM_TOKENS:
            qkv, qk, positions = _rope_case(device, dtype, num_tokens, seed=num_tokens + 100)
            g = _gen(num_tokens)
            qkv[:, (HEADS + KV_HEADS) * HEAD_DIM : (HEADS + 2 * KV_HEADS) * HEAD_DIM] = torch.randn(
                qkv.shape[0], KV_HEADS * HEAD_DIM, generator=g
            ).to(device, dtype)
            v = qkv[2 : 2 + num_tokens, (HEADS + KV_HEADS) * HEAD_DIM : (HEADS + 2 * KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
            k_cache, v_cache = (torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype) for _ in range(2))
            slots = torch.randperm(num_slots, generator=g)[:num_tokens].to(device)
            before = qkv.clone()
            ref_qk = rope.for_step(positions, dtype, None).apply(qk.clone())
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            ref_k.index_copy_(0, slots, ref_qk[:, HEADS:])
            ref_v.index_copy_(0, slots, v)
            step = rope.for_step(positions, dtype, ops)
            out, written = step.apply_writing_kv(qk, v, (k_cache, v_cache), slots)
            assert written and out.data_ptr() == qk.data_ptr()
            assert torch.equal(out, ref_qk), (dtype, num_tokens)
            assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), (dtype, num_tokens)
            mine = torch.zeros_like(qkv, dtype=torch.bool)
            mine[2 : 2 + num_tokens, : (HEADS + KV_HEADS) * HEAD_DIM] = True
            bits = {F32: torch.int32}.get(dtype, torch.int16)
            assert torch.equal(qkv.view(bits)[~mine], before.view(bits)[~mine]), "wrote outside its rows/heads"
    # Misshapen caches and slots are refused, not written past.
    ops = _ops(device, F32)
    qk = torch.randn(2, HEADS + KV_HEADS, HEAD_DIM, device=device)
    v = torch.randn(2, KV_HEADS, HEAD_DIM, device=device)
    cache = torch.zeros(8, KV_HEADS, HEAD_DIM, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    for bad in (
        lambda: ops.rope_write_kv_(qk, pos, rope.cos, rope.sin, v, cache[:, :, :32], cache[:, :, :32], pos),
        lambda: ops.rope_write_kv_(qk, pos, rope.cos, rope.sin, v[:1], cache, cache, pos),
        lambda: ops.rope_write_kv_(qk, pos, rope.cos, rope.sin, v, cache, cache, pos.to(torch.int32)),
    ):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("a misshapen cache, v or slot mapping must be a ValueError")


class _WithoutKvWrite:
    """The same ops, declaring no fused KV write: `Attention` then writes the cache itself."""

    fuses_kv_write = False

    def __init__(self, ops) -> None:
        self.ops = ops

    def __getattr__(self, name: str):
        return getattr(self.ops, name)


def check_attention_with_the_fused_kv_write(device: str) -> None:
    """`Attention.forward` with RoPE and the cache write fused gives the bits of the same ops with the
    write left to `paged_attention`: its output and both caches, over prefill and decode steps."""
    arch = _arch()
    block_size, num_blocks = 16, 8
    for dtype in (F32, BF16):
        ops = _ops(device, dtype)
        torch.manual_seed(5)
        attn = Attention(arch).to(device, dtype)
        rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, 100000.0).to(device)
        x = torch.randn(24, HIDDEN, generator=_gen(6)).to(device, dtype)
        results = []
        for fused in (ops, _WithoutKvWrite(ops)):
            caches = tuple(torch.zeros(num_blocks * block_size, KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
            table = np.array([[3, 1], [6, 0]])
            outs = []
            # two prompts of 9 and 13 tokens in one step, then one decode token each
            for starts, lens, rows in (([0, 0], [9, 13], slice(0, 22)), ([9, 13], [1, 1], slice(22, 24))):
                meta, positions = AttentionMetadata.build(np.array(starts), np.array(lens), table, block_size, device, dtype)
                step = rope.for_step(torch.as_tensor(positions, device=device), dtype, fused)
                outs.append(attn(x[rows], step, caches, meta))
            results.append((torch.cat(outs), *caches))
        for got, want in zip(*results):
            assert torch.equal(got, want), dtype


def check_batch_invariant(device: str) -> None:
    """A row's bits are the same alone, in a prefix, or among 17 rows."""
    for dtype in (F32, BF16):
        ops = _ops(device, dtype)
        g = _gen(7)
        x, residual = [torch.randn(17, HIDDEN, generator=g).to(device, dtype) for _ in range(2)]
        weight = (1 + 0.3 * torch.randn(HIDDEN, generator=g)).to(device, dtype)
        gate_up = (4 * torch.randn(17, 2 * INTER, generator=g)).to(device, dtype)
        cos, sin = (t.to(device) for t in (RotaryEmbedding(HEAD_DIM, MAX_POSITION, 1e5).cos, RotaryEmbedding(HEAD_DIM, MAX_POSITION, 1e5).sin))
        _, qk, positions = _rope_case(device, dtype, 17, seed=8)

        def run(rows: slice) -> list[torch.Tensor]:
            norm = ops.add_rms_norm(x[rows], residual[rows], weight, EPS)
            return [*norm, ops.silu_mul(gate_up[rows]), ops.rope_(qk[rows].clone(), positions[rows], cos, sin)]

        full = run(slice(None))
        for rows in (slice(0, 1), slice(5, 6), slice(16, 17), slice(0, 3), slice(4, 15)):
            for got, want in zip(run(rows), full):
                assert torch.equal(got, want[rows]), (dtype, rows)


def check_odd_sizes_and_zero_rows(device: str) -> None:
    """Sizes that are no power of two and no multiple of the block; empty batches launch nothing."""
    ops = _ops(device, F32)
    g = _gen(11)
    x, residual, weight = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g), torch.ones(7)
    out, r = ops.add_rms_norm(x.to(device), residual.to(device), weight.to(device), EPS)
    torch.testing.assert_close(out.cpu(), F.rms_norm(x + residual, (7,), eps=EPS), rtol=6e-7, atol=0)
    gate_up = torch.randn(2, 2 * 1025, generator=g)  # two silu programs per row, the second of one column
    gate, up = gate_up.split(1025, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up.to(device)).cpu(), F.silu(gate) * up, rtol=1e-6, atol=0)
    rope = RotaryEmbedding(6, 16, 1e4).to(device)
    qk = torch.randn(2, 5, 6, generator=g).to(device)
    positions = torch.tensor([3, 15], device=device)
    ref = rope.for_step(positions, F32, None).apply(qk.clone())
    assert torch.equal(ops.rope_(qk, positions, rope.cos, rope.sin), ref)
    out, r = ops.add_rms_norm(torch.empty(0, 7, device=device), None, weight.to(device), EPS)
    assert out.shape == r.shape == (0, 7)
    assert ops.silu_mul(torch.empty(0, 14, device=device)).shape == (0, 7)
    empty = torch.empty(0, 3, 6, device=device)
    assert ops.rope_(empty, torch.empty(0, dtype=torch.int64, device=device), rope.cos, rope.sin) is empty


def check_wrong_dtypes_are_type_errors(device: str) -> None:
    ops = _ops(device, BF16)
    x = torch.randn(2, 8, device=device)
    for call in (
        lambda: ops.add_rms_norm(x, None, torch.ones(8, dtype=BF16, device=device), EPS),
        lambda: ops.silu_mul(x),
        lambda: ops.rope_(x.to(BF16).view(2, 1, 8), torch.zeros(2, dtype=torch.int32, device=device), x, x),
    ):
        try:
            call()
        except TypeError:
            continue
        raise AssertionError("a tensor of another dtype must be a TypeError")


CHECKS = [
    check_add_rms_norm,
    check_silu_mul,
    check_silu_over_the_whole_range,
    check_rope,
    check_rope_write_kv,
    check_attention_with_the_fused_kv_write,
    check_batch_invariant,
    check_odd_sizes_and_zero_rows,
    check_wrong_dtypes_are_type_errors,
]

if __name__ == "__main__":
    main(CHECKS)
