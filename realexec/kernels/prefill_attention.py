"""Paged prefill / extend attention: new query tokens attend to the cached prefix plus
themselves (causally), all K/V read from the paged cache.

The caller stores the new tokens' K/V first (`store_kvcache`), so the cache holds every
position [0, seq_len) of each sequence and one code path serves:
  * plain prefill (context 0),
  * prefix-cache hits (context = the cached prefix),
  * chunked prefill (context = the chunks computed in earlier steps),
  * decode tokens mixed into the same batch (query length 1).

Indexing. Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]) of q/out;
its query length is q_len = query_start_loc[b+1] - query_start_loc[b] and its context
(positions already cached before this step) is ctx = seq_lens[b] - q_len. Query i (0-based
within the sequence's new tokens) sits at absolute position ctx + i and sees key positions
j <= ctx + i.

Tiling. One program per (sequence, query tile of BLOCK_M rows, query head); the grid is
(num_seqs, cdiv(max_query_len, BLOCK_M), Hq), so tiles past a short sequence's q_len do
nothing. The program keeps its [BLOCK_M, D] query tile in registers and streams key tiles of
BLOCK_N positions from 0 up to the last position visible to the tile's last valid query,
min(seq_len, ctx + min(tile_end, q_len)). Like decode, each key position gathers its
physical block id from the block table, so BLOCK_N is independent of block_size.
Scores: S = Q @ K^T (fp32 accumulate), masked by pos < kv_end and the causal condition
pos <= ctx + i; online softmax in base 2 (exp2 with scale*log2(e) folded into S) with a
finite initial max so fully masked rows never produce NaN. Rows with no visible key (only
possible for inconsistent padding rows, e.g. seq_len 0 with a query row) write zeros.

Sliding window W (runtime, 0 = none): query i also needs pos > ctx + i - W, and the key loop
starts at the first key the tile's first query sees, ctx + tile_start - W + 1. Soft cap:
as in decode_attention (HAS_SOFT_CAP constexpr, cap in base-2 units).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import LOG2E, dot_precision, soft_cap_arg, soft_cap_tanh, window_arg


# The block-table width changes from step to step: no recompile when it happens to be 1 or a
# multiple of 16 (Triton specializes integer arguments on those by default).
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,                      # [T, Hq, D]
    k_cache_ptr, v_cache_ptr,   # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,           # [B, max_blocks] int32
    seq_lens_ptr,               # [B] int32 (context after this step)
    query_start_loc_ptr,        # [B + 1] int32
    out_ptr,                    # [T, Hq, D]
    sm_scale_log2,
    window,                     # sliding window (0: none)
    soft_cap_log2,              # soft cap * log2(e) (used when HAS_SOFT_CAP)
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    head_dim,
    BLOCK_SIZE: tl.constexpr,   # cache block size (constexpr: pos // BLOCK_SIZE becomes a shift)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)   # query index within the sequence
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = ctx + offs_m                               # absolute positions of the queries

    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    # Keys visible to some valid query of this tile: [0, kv_end). Empty for a tile past q_len.
    tile_last = tl.minimum((tile + 1) * BLOCK_M, q_len)     # one past the tile's last query
    kv_end = tl.minimum(seq_len, ctx + tile_last)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
    # Window (a huge one when there is none): keys before the tile's first query's window
    # are visible to no query of the tile.
    win = tl.where(window > 0, window, 1 << 30)
    kv_lo = tl.maximum(ctx + tile * BLOCK_M - win + 1, 0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_end, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < kv_end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]

        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)                                     # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2   # [BLOCK_M, BLOCK_N]
        if HAS_SOFT_CAP:
            s = soft_cap_tanh(s, soft_cap_log2)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - win)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
             + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over (cached prefix + new tokens), read from the cache.

    q: [T, Hq, D] flattened new tokens, sequence b owning rows
    query_start_loc[b]:query_start_loc[b+1]; k_cache/v_cache: [num_blocks, block_size, Hkv, D]
    with the new tokens already stored; block_tables [B, max_blocks] int32; seq_lens [B] int32
    (context after this step); max_query_len: host int >= every query length (sizes the grid).
    Returns out [T, Hq, D] in q's dtype; rows not covered by query_start_loc are not written.
    sliding_window: attend to the last W positions only; logits_soft_cap: c * tanh(s / c) scores.
    """
    T, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert Hq % Hkv == 0, (Hq, Hkv)
    B = seq_lens.shape[0]
    assert block_tables.shape[0] == B and query_start_loc.shape[0] == B + 1
    if out is None:
        out = torch.empty_like(q)
    if B == 0 or T == 0 or max_query_len <= 0:
        return out

    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_M = block_m or (64 if BLOCK_D <= 64 else 32)
    BLOCK_N = block_n or (64 if BLOCK_D <= 64 else 32)
    grid = (B, triton.cdiv(max_query_len, BLOCK_M), Hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        float(scale) * LOG2E, window_arg(sliding_window), soft_cap_arg(logits_soft_cap),
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        D,
        BLOCK_SIZE=block_size,
        GROUP=Hq // Hkv, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        DOT_PRECISION=dot_precision(q.dtype), HAS_SOFT_CAP=bool(logits_soft_cap),
        num_warps=num_warps,
    )
    return out


__all__ = ["prefill_attention"]
