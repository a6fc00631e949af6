"""Paged attention over a flat KV cache, for mixed prefill + decode batches.

The cache of one layer is `[num_blocks * block_size, num_kv_heads, head_dim]`
for K and for V; a token at position p of a request lives in slot
`block_ids[p // block_size] * block_size + p % block_size`.

`AttentionMetadata.build` turns one step's requests into index tensors once
per step (numpy, vectorised over tokens); every layer reuses them.

With the decode kernel (`asyncpp.kernels.decode_attention`, CPU), every
query token, prefill or decode, is attended on its own as a decode at its
position: keys are read in place through the block table in one fixed order.
A token's output then depends only on its request's context, never on what
shares the step, how the prompt was chunked, or whether its prefix came from
the prefix cache: greedy output is the same for any batching and pp size.
(It is also faster than `scaled_dot_product_attention` on prompts here.)

Without the kernel (another device or dtype, no C compiler), torch does it:
requests computing one token (decode) are batched together with a
key-padding mask, in buckets of similar context length so little time goes
to padding; requests computing their first tokens (a prompt's first chunk,
nothing cached) attend to this step's own keys, one causal SDPA call per
request; other prefill chunks (after cached prefix blocks or earlier chunks)
are batched with a causal mask offset by their start position. Keys and
values are gathered a whole block at a time (`index_select`, several times
faster than advanced indexing on CPU). These paths round differently from
each other, so they are close to, not bit-identical with, one another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from asyncpp.host_copy import to_device
from asyncpp.kernels.decode_attention import DecodeAttention

# Decode requests are split into buckets of at least this many requests, sorted by context length.
_MIN_DECODE_BUCKET = 32


@dataclass
class _Group:
    """Requests attended together: queries padded to `max_q`, keys to whole blocks."""

    token_idx: torch.Tensor  # [num_valid] rows of the flat token axis, in (request, query) order
    query_idx: torch.Tensor  # [num_reqs, max_q] flat token row per padded query (padding -> 0)
    query_valid: torch.Tensor | None  # [num_reqs, max_q] bool; None when every query is valid (decode)
    key_blocks: torch.Tensor  # [num_reqs * num_key_blocks] block ids, row-major (padding -> block 0)
    # [num_reqs, 1, max_q, num_key_blocks * block_size] additive (0 = attend, -inf = masked), in the
    # activation dtype: SDPA would otherwise convert a bool mask on every call of every layer.
    mask: torch.Tensor


@dataclass
class _KernelRows:
    """Query tokens computed one by one by the decode kernel, straight from the paged cache."""

    fn: DecodeAttention
    rows: torch.Tensor  # [n] token row of each query and its output
    block_table: torch.Tensor  # [n, max_num_blocks] the block table of each query's request
    context_lens: torch.Tensor  # [n] keys each query attends: its position + 1
    max_context_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    groups: list[_Group]
    block_size: int
    kernel_rows: _KernelRows | None = None
    fresh_prefills: list[tuple[int, int]] = field(default_factory=list)  # token rows [start, end) per request

    @staticmethod
    def build(
        start_positions: np.ndarray,  # [num_reqs] tokens already in the cache per request
        num_new_tokens: np.ndarray,  # [num_reqs] tokens computed this step per request
        block_table: np.ndarray,  # [num_reqs, max_num_blocks] int, padded
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        decode_kernel: DecodeAttention | None = None,
        upload: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> tuple["AttentionMetadata", np.ndarray]:
        """Return the metadata and the positions `[num_tokens]` of the step's tokens. `upload` puts
        an int64 array on `device` (default `to_device`; a stage stages them all in one copy)."""
        upload = upload or (lambda a: to_device(a, device))
        num_reqs = len(num_new_tokens)
        query_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new_tokens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        req_of_token = np.repeat(np.arange(num_reqs), num_new_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - query_start[req_of_token] + start_positions[req_of_token]
        slot_mapping = block_table[req_of_token, positions // block_size] * block_size + positions % block_size

        groups = []
        kernel_rows = None
        fresh_prefills = []
        if decode_kernel is not None:
            # Every query token is attended as a decode at its position, prefill chunks included: a
            # token's result is then the same whatever shares its step, whether its prefix came from
            # the prefix cache or an earlier chunk, and whether it was computed in a prefill or a decode.
            context_lens = positions + 1
            kernel_rows = _KernelRows(
                fn=decode_kernel,
                rows=upload(np.arange(num_tokens, dtype=np.int64)),
                block_table=upload(block_table[req_of_token]),
                context_lens=upload(context_lens),
                max_context_len=int(context_lens.max()),
            )
        else:
            is_decode = num_new_tokens == 1
            is_fresh = ~is_decode & (start_positions == 0)
            fresh_prefills = [(int(query_start[i]), int(query_start[i + 1])) for i in np.nonzero(is_fresh)[0]]
            prefills = np.nonzero(~is_decode & ~is_fresh)[0]
            batches = _decode_buckets(np.nonzero(is_decode)[0], start_positions) + ([prefills] if len(prefills) else [])
            groups = [
                _build_group(reqs, start_positions, num_new_tokens, query_start, block_table, block_size, device, dtype)
                for reqs in batches
            ]
        meta = AttentionMetadata(
            slot_mapping=upload(slot_mapping),
            groups=groups,
            block_size=block_size,
            kernel_rows=kernel_rows,
            fresh_prefills=fresh_prefills,
        )
        return meta, positions


def _decode_buckets(decodes: np.ndarray, start_positions: np.ndarray) -> list[np.ndarray]:
    """Split decode requests into a few buckets of similar context length (less key padding)."""
    if len(decodes) == 0:
        return []
    num_buckets = max(1, len(decodes) // _MIN_DECODE_BUCKET)
    if num_buckets == 1:
        return [decodes]
    ordered = decodes[np.argsort(start_positions[decodes], kind="stable")]
    return np.array_split(ordered, num_buckets)


def _build_group(
    reqs: np.ndarray,
    start_positions: np.ndarray,
    num_new_tokens: np.ndarray,
    query_start: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> _Group:
    starts = start_positions[reqs]
    lens = num_new_tokens[reqs]
    max_q = int(lens.max())
    max_ctx = int((starts + lens).max())

    q_offsets = np.arange(max_q)
    query_valid = q_offsets[None, :] < lens[:, None]
    query_idx = np.where(query_valid, query_start[reqs][:, None] + q_offsets[None, :], 0)

    num_key_blocks = -(-max_ctx // block_size)
    key_blocks = np.zeros((len(reqs), num_key_blocks), dtype=np.int64)
    width = min(num_key_blocks, block_table.shape[1])
    key_blocks[:, :width] = block_table[reqs][:, :width]
    key_pos = np.arange(num_key_blocks * block_size)

    # Causal with an offset: query i of a request sits at position start + i. This also
    # masks key positions past the request's context (always > its last query position).
    query_pos = starts[:, None] + q_offsets[None, :]  # [num_reqs, max_q]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    # Padding queries attend to key 0 only so softmax never sees an all-masked row.
    mask[~query_valid] = False
    mask[..., 0] |= ~query_valid

    to = lambda a: to_device(a, device)  # noqa: E731
    all_valid = bool(query_valid.all())
    return _Group(
        token_idx=to(query_idx[query_valid]),
        query_idx=to(query_idx),
        query_valid=None if all_valid else to(query_valid),
        key_blocks=to(key_blocks.reshape(-1)),
        mask=torch.zeros(mask.shape, dtype=dtype).masked_fill_(torch.from_numpy(~mask), float("-inf"))[:, None].to(device),
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,  # k and v are in the cache already (the fused RoPE + KV write did it)
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    # Write first, then read: a request's new tokens attend to themselves through the cache.
    if not kv_written:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    k_blocks = k_cache.view(-1, meta.block_size, num_kv_heads, head_dim)
    v_blocks = v_cache.view(-1, meta.block_size, num_kv_heads, head_dim)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if (kd := meta.kernel_rows) is not None:
        kd.fn(q, k_cache, v_cache, kd.block_table, kd.rows, kd.context_lens, kd.max_context_len, meta.block_size, out, scale)
    for start, end in meta.fresh_prefills:
        # [1, heads, len, head_dim] views of this step's rows: the request's whole context is here.
        # (4-D: torch's CPU flash kernel takes no 3-D input and would fall back to the math path.)
        qr, kr, vr = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        og = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = og[0].transpose(0, 1).reshape(end - start, num_heads * head_dim)
    for g in meta.groups:
        num_reqs = g.query_idx.shape[0]
        qg = q[g.query_idx].transpose(1, 2)  # [num_reqs, num_heads, max_q, head_dim]
        # [num_reqs, num_kv_heads, num_key_blocks * block_size, head_dim]
        kg = k_blocks.index_select(0, g.key_blocks).view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        vg = v_blocks.index_select(0, g.key_blocks).view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
        og = og.transpose(1, 2)  # [num_reqs, max_q, num_heads, head_dim]
        rows = og.reshape(-1, num_heads * head_dim) if g.query_valid is None else og[g.query_valid].reshape(-1, num_heads * head_dim)
        out[g.token_idx] = rows
    return out
