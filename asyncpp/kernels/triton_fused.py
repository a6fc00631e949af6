"""Fused elementwise ops of the Llama layer on CUDA through Triton: the GPU twin of `fused_ops.c`.

The same contract as the C ops (`asyncpp.kernels.fused_ops.FusedOps`): add +
RMSNorm, SiLU * up and RoPE in place, each one kernel launch instead of the
several the torch code takes, with the roundings of the torch code in
`asyncpp.model.llama` for the activation dtype:

  add_rms_norm: r = dtype(residual + x); out = dtype(w * dtype(r * inv_rms)),
                inv_rms = 1 / sqrt(mean(r^2) + eps) from a float64 sum, rounded to float32 once
  silu_mul:     out = dtype(dtype(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in float32
                (libdevice's expf and a correctly rounded division, like torch's CUDA kernel)
  rope_:        x = dtype(dtype(x * c) + dtype(rotate_half(x) * s)), c, s = dtype(cos), dtype(sin)

Every product and sum is rounded where torch rounds it (the kernels are
compiled without FMA contraction), so the residual add and RoPE are
bit-identical to torch and the norm and SiLU differ only by torch's own
float32 rounding of the sum of squares, rsqrt and exp. Each program owns
whole rows (or a fixed slice of one): a row's result never depends on the
rows beside it.

On an H200 (Triton 3.6, torch 2.11, `scripts/fused_ab.py`, 2026-11-28): SmolLM2's
30 layers without attention (norms, qkv, RoPE, o_proj, MLP, final norm) in bfloat16,
ms per step, torch code -> fused ops: one CUDA graph replay 1.50 -> 0.76 (1 token),
1.76 -> 0.79 (64), 1.86 -> 0.86 (256); eager 7.9 -> 11.4 (1 token: a Triton launch
costs more host time than a torch op), 12.7 -> 7.4 (64), 9.3 -> 7.3 (256). Outputs
were identical at 1 and 64 tokens; at 256, 1.9% differ (max 0.0625) after 30 layers:
the norm is the one op not bit-exact (1 / rms from a float64 sum here, torch's float32
sum and rsqrt there), and a rare one-step difference spreads through later layers.

Launches are CUDA-graph capturable: grids and outputs come from shapes only,
nothing reads a tensor's values on the host. `triton_fused_ops(device,
dtype)` returns the ops for CUDA devices (any device under Triton's
interpreter, `TRITON_INTERPRET=1` set before the first launch), or None
where Triton or the dtype is missing. Importing this module never needs Triton.
"""

from __future__ import annotations

import struct

import torch

from asyncpp.kernels.triton_attention import has_triton, is_interpreted, pow2

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SILU_BLOCK = 1024  # elements of one row per silu_mul program


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def check_dtypes(dtype: torch.dtype, tensors: tuple[torch.Tensor, ...]) -> None:
    """Fused ops (C or Triton) are built for one activation dtype: another is a `TypeError`."""
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"fused ops for {dtype} got a {t.dtype} tensor")


class TritonFusedOps:
    """Each op takes tensors of `dtype` on one device whose last dimension is contiguous (cos/sin: float32)."""

    fuses_kv_write = True

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in DTYPES:
            raise TypeError(f"Triton fused ops take {DTYPES}, not {dtype}")
        self.dtype = dtype
        self._norm, self._silu, self._rope = _build_kernels()

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x) * weight, residual + x) for `[num_tokens, hidden]`; no input is modified."""
        self._check(x, weight, x if residual is None else residual)
        x, weight = _rows(x), weight.contiguous()
        res = x if residual is None else _rows(residual)
        num_tokens, hidden = x.shape
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
        residual_out = torch.empty_like(out)
        if num_tokens:
            block = pow2(hidden)
            self._norm[(num_tokens,)](
                x, x.stride(0), res, res.stride(0), weight, residual_out, out, hidden, _float32(eps),
                HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block), enable_fp_fusion=False,
            )  # fmt: skip
        return out, residual_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, 2 * inter]` -> silu(gate) * up `[num_tokens, inter]`."""
        self._check(gate_up)
        gate_up = _rows(gate_up)
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
        if num_tokens and inter:
            block = min(SILU_BLOCK, pow2(inter))
            grid = (num_tokens, -(-inter // block))
            self._silu[grid](
                gate_up, gate_up.stride(0), out, inter,
                BLOCK=block, LIBDEVICE=not is_interpreted(), enable_fp_fusion=False,
            )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[num_tokens, num_heads, head_dim]` in place; cos/sin `[max_position, head_dim]` float32."""
        return self._rope_(x, positions, cos, sin, None)

    def rope_write_kv_(
        self, qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """`rope_` of `qk` `[num_tokens, num_q_heads + num_kv_heads, head_dim]` (the k heads last), and in the
        same launch each token's rotated k heads and its `v` `[num_tokens, num_kv_heads, head_dim]` written
        to row `slot_mapping[t]` of the caches `[num_slots, num_kv_heads, head_dim]` (contiguous): what
        `rope_` then two `index_copy_` give, one launch instead of three."""
        self._check(qk, v, k_cache, v_cache)
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
            raise ValueError(f"rope_write_kv_: caches must be contiguous and alike, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        if v.shape != (qk.shape[0], num_kv_heads, head_dim) or v.stride(2) != 1 or v.stride(1) != head_dim:
            raise ValueError(f"rope_write_kv_: v {tuple(v.shape)} / {v.stride()} does not match the cache")
        if qk.shape[1] < num_kv_heads or qk.shape[2] != head_dim:
            raise ValueError(f"rope_write_kv_: qk {tuple(qk.shape)} does not end with the cache's {num_kv_heads} heads")
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (qk.shape[0],):
            raise ValueError(f"rope_write_kv_: slot_mapping must be int64 [{qk.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
        return self._rope_(qk, positions, cos, sin, (v, k_cache, v_cache, slot_mapping.contiguous()))

    def _rope_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        self._check(x)
        num_tokens, num_heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2:
            raise ValueError(f"rope_: unsupported layout {tuple(x.shape)} / {x.stride()}")
        if positions.dtype != torch.int64 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise TypeError(f"rope_: positions must be int64 and cos/sin float32, got {positions.dtype}, {cos.dtype}")
        positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
        if num_tokens and num_heads:
            half = head_dim // 2
            block = pow2(num_heads) * pow2(half)
            v, k_cache, v_cache, slots = kv if kv is not None else (x, x, x, positions)  # unused without WRITE_KV
            num_kv_heads = k_cache.shape[1] if kv is not None else 1
            self._rope[(num_tokens,)](
                x, x.stride(0), positions, cos, sin, num_heads, half,
                v, v.stride(0), k_cache, v_cache, slots, num_heads - num_kv_heads, num_kv_heads,
                HEADS_P=pow2(num_heads), HALF_P=pow2(half), WRITE_KV=kv is not None, KV_HEADS_P=pow2(num_kv_heads),
                num_warps=_num_warps(block), enable_fp_fusion=False,
            )  # fmt: skip
        return x

    def _check(self, *tensors: torch.Tensor) -> None:
        check_dtypes(self.dtype, tensors)


def triton_fused_ops(device: torch.device | str, dtype: torch.dtype) -> TritonFusedOps | None:
    """The ops for CUDA devices (any device under Triton's interpreter); None without Triton or for other dtypes."""
    if not has_triton() or dtype not in DTYPES:
        return None
    if torch.device(device).type != "cuda" and not is_interpreted():
        return None
    return TritonFusedOps(dtype)


def _float32(v: float) -> float:
    """`v` rounded to float32, the eps the kernel sees on any backend (the interpreter keeps Python floats)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` `[rows, n]` with a contiguous last dimension (rows may stay strided); a copy only where it is not."""
    return t if t.dim() == 2 and t.stride(1) == 1 else t.reshape(t.shape[0], -1).contiguous()


_KERNELS = None


def _build_kernels():
    """Compile-on-first-use: importing this module never needs Triton."""
    global _KERNELS, _rounded
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice  # noqa: F401  (tl.extra.libdevice below)

    # A module global, not a closure: the interpreter runs kernels against their module's globals.
    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """float32 `x` rounded to `dtype` (to nearest, ties to even), kept in float32. bfloat16 rounds by
        its bits: the interpreter's float32 -> bfloat16 cast truncates; the GPU's cvt.rn agrees with this."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def add_rms_norm(
        x_ptr, x_stride, res_ptr, res_stride, w_ptr, res_out_ptr, out_ptr, hidden, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        r = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # one rounding of the float32 sum, like torch's residual + x
            res = tl.load(res_ptr + row * res_stride + cols, mask=ok, other=0.0).to(tl.float32)
            r = _rounded(res + r, dtype)
        tl.store(res_out_ptr + row * hidden + cols, r.to(dtype), mask=ok)  # exact: r is a `dtype` value
        rd = r.to(tl.float64)  # each square exact in float64: the sum's order does not matter at float32
        mean_sq = tl.sum(rd * rd, axis=0) / hidden
        inv_rms = (1.0 / tl.sqrt(mean_sq + eps)).to(tl.float32)
        normed = _rounded(r * inv_rms, dtype)  # torch: rms_norm in float32, then .to(dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, _rounded(w * normed, dtype).to(dtype), mask=ok)

    @triton.jit
    def silu_mul(gate_up_ptr, gate_up_stride, out_ptr, inter, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        g = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + row * gate_up_stride + inter + cols, mask=ok, other=0.0).to(tl.float32)
        if LIBDEVICE:  # expf, like torch's CUDA kernel (tl.exp is the faster, rougher ex2.approx)
            e = tl.extra.libdevice.exp(-g)
        else:  # the interpreter has no libdevice; its tl.exp is numpy's
            e = tl.exp(-g)
        s = _rounded(tl.math.div_rn(g, 1.0 + e), dtype)  # torch's F.silu: float32, then rounded
        tl.store(out_ptr + row * inter + cols, _rounded(s * u, dtype).to(dtype), mask=ok)

    @triton.jit
    def rope(
        x_ptr, x_stride, pos_ptr, cos_ptr, sin_ptr, num_heads, half,
        v_ptr, v_stride, k_cache_ptr, v_cache_ptr, slot_ptr, num_q_heads, num_kv_heads,
        HEADS_P: tl.constexpr, HALF_P: tl.constexpr, WRITE_KV: tl.constexpr, KV_HEADS_P: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS_P)
        cols = tl.arange(0, HALF_P)
        col_ok = cols < half
        ok = (heads < num_heads)[:, None] & col_ok[None, :]
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        table = tl.load(pos_ptr + row) * (2 * half)
        # cos/sin cast to the activation dtype first, like the torch code.
        c0 = _rounded(tl.load(cos_ptr + table + cols, mask=col_ok, other=0.0), dtype)[None, :]
        c1 = _rounded(tl.load(cos_ptr + table + half + cols, mask=col_ok, other=0.0), dtype)[None, :]
        s0 = _rounded(tl.load(sin_ptr + table + cols, mask=col_ok, other=0.0), dtype)[None, :]
        s1 = _rounded(tl.load(sin_ptr + table + half + cols, mask=col_ok, other=0.0), dtype)[None, :]
        lo_ptrs = x_ptr + row * x_stride + heads[:, None] * (2 * half) + cols[None, :]
        lo = tl.load(lo_ptrs, mask=ok, other=0.0).to(tl.float32)
        hi = tl.load(lo_ptrs + half, mask=ok, other=0.0).to(tl.float32)
        # rotate_half(x) = [-hi, lo]: x * cos + rotate_half(x) * sin, each product and the sum rounded.
        new_lo = _rounded(_rounded(lo * c0, dtype) + _rounded(-hi * s0, dtype), dtype)
        new_hi = _rounded(_rounded(hi * c1, dtype) + _rounded(lo * s1, dtype), dtype)
        tl.store(lo_ptrs, new_lo.to(dtype), mask=ok)
        tl.store(lo_ptrs + half, new_hi.to(dtype), mask=ok)
        if WRITE_KV:  # heads past the q heads are k: the rotated values go to the cache slot too, and so does v
            slot = tl.load(slot_ptr + row)
            kv_row = slot * num_kv_heads * (2 * half)
            k_ok = ok & (heads >= num_q_heads)[:, None]
            k_ptrs = k_cache_ptr + kv_row + (heads - num_q_heads)[:, None] * (2 * half) + cols[None, :]
            tl.store(k_ptrs, new_lo.to(dtype), mask=k_ok)
            tl.store(k_ptrs + half, new_hi.to(dtype), mask=k_ok)
            kv_heads = tl.arange(0, KV_HEADS_P)
            v_ok = (kv_heads < num_kv_heads)[:, None] & col_ok[None, :]
            v_offs = kv_heads[:, None] * (2 * half) + cols[None, :]
            v_lo = tl.load(v_ptr + row * v_stride + v_offs, mask=v_ok, other=0.0)
            v_hi = tl.load(v_ptr + row * v_stride + v_offs + half, mask=v_ok, other=0.0)
            tl.store(v_cache_ptr + kv_row + v_offs, v_lo, mask=v_ok)
            tl.store(v_cache_ptr + kv_row + v_offs + half, v_hi, mask=v_ok)

    _KERNELS = (add_rms_norm, silu_mul, rope)
    return _KERNELS
