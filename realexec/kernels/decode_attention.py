"""Paged decode attention: one new query token per sequence, K/V read through block tables.

Tiling and GQA packing
----------------------
Stage 1 runs one program per (sequence, kv head, kv split). The program handles *all*
GROUP = num_q_heads // num_kv_heads query heads that share its kv head at once: their
query vectors form a [BLOCK_H, BLOCK_D] tile (BLOCK_H = GROUP rounded up to a power of two,
at least 16, the rows past GROUP are masked to zero and never stored). Every K/V tile is
therefore loaded once per kv head instead of once per query head, and both products are
real matrix products that map onto tensor cores:

    S  = Q  [BLOCK_H, D] @ K^T [D, BLOCK_N]   -> [BLOCK_H, BLOCK_N]   (fp32 accumulate)
    O += P  [BLOCK_H, BLOCK_N] @ V [BLOCK_N, D]                         (fp32 accumulate)

(tl.dot needs every dimension >= 16 on the GPU, hence the minimum of 16 for BLOCK_H,
BLOCK_N and BLOCK_D.) A K/V tile of BLOCK_N consecutive token positions may span several
cache blocks: the program gathers one physical block id per position from the block
table (`block_tables[seq, pos // BLOCK_SIZE]`) and addresses
`cache[block, pos % BLOCK_SIZE, kv_head, :]`, so BLOCK_N is independent of block_size.

Online softmax in base 2: scores are multiplied by scale*log2(e) and exponentiated with
exp2; the running max starts at a large finite negative number (not -inf) so that a row
whose every key is masked never computes (-inf) - (-inf) = NaN.

Sliding window and soft cap
--------------------------
With `window` W > 0 only positions [seq_len - W, seq_len) are visited (and split); with a
soft cap c the scaled scores s become c * tanh(s / c) before the mask (in base-2 units:
s2 -> c2 * tanh(s2 / c2) with c2 = c * log2(e)). tanh is computed as 2 * sigmoid(2x) - 1
(portable: the interpreter and every GPU). Both are runtime arguments (window 0 = none);
the cap's code is compiled in only when HAS_SOFT_CAP, so uncapped models pay nothing.

Split-KV
--------
A sequence's positions [0, seq_len) are cut into NUM_SPLITS contiguous chunks of
`ceil(ceil(seq_len / NUM_SPLITS) / BLOCK_N) * BLOCK_N` positions (tile aligned); split j
processes chunk j (possibly empty). Each split writes its normalized partial output and
its log-sum-exp (base 2; -inf when empty) to scratch buffers; a small stage-2 kernel, one
program per (sequence, query head), merges them:

    m = max_j lse_j ;  w_j = 2^(lse_j - m) ;  out = sum_j w_j * o_j / sum_j w_j

With NUM_SPLITS == 1 stage 1 writes the final output directly and stage 2 is skipped.

CUDA-graph safety
-----------------
The grids are (num_seqs, num_kv_heads, NUM_SPLITS) and (num_seqs, num_q_heads): shapes and
constants only. seq_lens, block tables and query_start_loc are read *inside* the kernels;
nothing on the host looks at their values. Pick NUM_SPLITS per batch-size bucket with
`default_num_kv_splits` (a function of batch size, head count and SM count only).

Padding
-------
A row with seq_len 0 processes no keys and writes zeros (l == 0 is guarded). A row with
query length 0 (query_start_loc[i+1] == query_start_loc[i]) stores nothing. Keys past
seq_len are masked in the loads (other=0, so stale NaNs in the cache cannot leak through a
0 * NaN product) and in the scores (-inf), and block-table entries past the last block are
never loaded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # 1 / ln(2)


@triton.jit
def soft_cap_tanh(s, cap):
    """cap * tanh(s / cap), as 2 * sigmoid(2x) - 1 (no tanh in the interpreter's tl.math)."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


def window_arg(sliding_window: int | None) -> int:
    """The kernels' window argument: 0 for none."""
    return int(sliding_window or 0)


def soft_cap_arg(logits_soft_cap: float | None) -> float:
    """The kernels' soft-cap argument in base-2 units (scores are scaled by log2(e))."""
    return float(logits_soft_cap) * LOG2E if logits_soft_cap else 0.0


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to TF32 on the GPU; fp16/bf16 use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


# The block-table width changes from step to step: no recompile when it happens to be 1 or a
# multiple of 16 (Triton specializes integer arguments on those by default).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_stage1_kernel(
    q_ptr,                      # [T, Hq, D]
    k_cache_ptr, v_cache_ptr,   # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,           # [B, max_blocks] int32
    seq_lens_ptr,               # [B] int32
    query_start_loc_ptr,        # [B + 1] int32: the query of seq b is row query_start_loc[b]
    out_ptr,                    # [T, Hq, D]      (written when NUM_SPLITS == 1)
    mid_o_ptr,                  # [B, Hq, S, D]  fp32 (written when NUM_SPLITS > 1)
    mid_lse_ptr,                # [B, Hq, S]     fp32
    sm_scale_log2,              # softmax scale * log2(e)
    window,                     # sliding window (0: none)
    soft_cap_log2,              # soft cap * log2(e) (used when HAS_SOFT_CAP)
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    stride_mob, stride_moh, stride_mos, stride_mod,
    stride_mlb, stride_mlh, stride_mls,
    head_dim,
    BLOCK_SIZE: tl.constexpr,   # cache block size (constexpr: pos // BLOCK_SIZE becomes a shift)
    GROUP: tl.constexpr,        # query heads per kv head
    BLOCK_H: tl.constexpr,      # GROUP padded to a power of two >= 16
    BLOCK_D: tl.constexpr,      # head_dim padded to a power of two >= 16
    BLOCK_N: tl.constexpr,      # key positions per tile
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq)
    has_query = tl.load(query_start_loc_ptr + seq + 1) > q_row

    # The visible keys [kv_lo, seq_len): all, or the last `window` ones.
    kv_lo = tl.maximum(seq_len - tl.where(window > 0, window, seq_len), 0)
    # This split's chunk of key positions, [kv_start, kv_end); empty when past seq_len.
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_start = kv_lo + split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    d_mask = offs_d < head_dim
    heads = kv_head * GROUP + offs_h          # query heads packed into this program
    # Rows that exist in q/out: none when this sequence has no query row. (The scalar
    # condition is folded into a block comparison; the interpreter mis-types
    # `block_mask & scalar_mask`.)
    row_mask = offs_h < tl.where(has_query, GROUP, 0)

    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)   # running max (base-2 units)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)           # running sum of 2^(s - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)  # running sum of p * v

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < kv_end
        # One physical block id per position; only entries < seq_len are ever loaded.
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]

        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)                                    # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_H, BLOCK_N]
        if HAS_SOFT_CAP:
            s = soft_cap_tanh(s, soft_cap_log2)
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)                                    # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]   # zeros for an empty split / seq_len 0
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])
    else:
        mid = mid_o_ptr + seq * stride_mob + heads[:, None] * stride_moh + split * stride_mos
        tl.store(mid + offs_d[None, :] * stride_mod, o, mask=head_mask[:, None] & d_mask[None, :])
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + seq * stride_mlb + heads * stride_mlh + split * stride_mls, lse,
                 mask=head_mask)


@triton.jit
def _decode_stage2_kernel(
    mid_o_ptr, mid_lse_ptr, query_start_loc_ptr, out_ptr,
    stride_mob, stride_moh, stride_mos, stride_mod,
    stride_mlb, stride_mlh, stride_mls,
    stride_ot, stride_oh, stride_od,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,      # NUM_SPLITS padded to a power of two
    BLOCK_D: tl.constexpr,
):
    """Merge the per-split partial outputs of one (sequence, query head) by their LSEs."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    has_query = tl.load(query_start_loc_ptr + seq + 1) > q_row

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < head_dim
    out_mask = offs_d < tl.where(has_query, head_dim, 0)   # nothing to write without a query row

    lse = tl.load(mid_lse_ptr + seq * stride_mlb + head * stride_mlh + offs_s * stride_mls,
                  mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)      # all splits empty (seq_len 0): weights -> 0
    w = tl.exp2(lse - m)                           # 0 for empty splits
    o = tl.load(mid_o_ptr + seq * stride_mob + head * stride_moh + offs_s[:, None] * stride_mos
                + offs_d[None, :] * stride_mod,
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=out_mask)


def default_num_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Number of KV splits for a decode batch: the smallest power of two that gives about two
    stage-1 programs per SM, capped at `max_splits`. Depends only on shapes and the device,
    never on sequence lengths, so one value per CUDA-graph batch bucket is stable."""
    splits = 1
    while splits < max_splits and batch_size * num_kv_heads * splits < 2 * num_sms:
        splits *= 2
    return splits


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_kv_splits: int = 1,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Paged decode attention for a batch of B sequences with one query token each.

    q: [T, Hq, D]; the query of sequence b is row query_start_loc[b] (normally T == B and
    query_start_loc == arange(B + 1)); a sequence with query length 0 gets no output row.
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]. block_tables: [B, max_blocks] int32.
    seq_lens: [B] int32, context length *including* the new token (already stored).
    Returns out [T, Hq, D] in q's dtype (rows of sequences with seq_len 0 are zeros).
    sliding_window: attend to the last W keys only; logits_soft_cap: c * tanh(s / c) scores.

    No host synchronisation and a data-independent grid: safe to capture in a CUDA graph
    for a fixed (B, num_kv_splits).
    """
    T, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert Hq % Hkv == 0, (Hq, Hkv)
    B = seq_lens.shape[0]
    assert block_tables.shape[0] == B and query_start_loc.shape[0] == B + 1
    assert num_kv_splits >= 1
    group = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    if B == 0 or T == 0:
        return out

    BLOCK_H = max(16, triton.next_power_of_2(group))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = block_n or (64 if BLOCK_D <= 128 else 32)
    S = int(num_kv_splits)
    if S > 1:
        mid_o = torch.empty((B, Hq, S, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    else:  # unused by the kernel (constexpr branch); any tensor will do for the pointer
        mid_o = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        mid_lse = out.new_empty((1, 1, 1), dtype=torch.float32)

    _decode_stage1_kernel[(B, Hkv, S)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, mid_o, mid_lse,
        float(scale) * LOG2E, window_arg(sliding_window), soft_cap_arg(logits_soft_cap),
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(), *mid_o.stride(), *mid_lse.stride(),
        D,
        BLOCK_SIZE=block_size,
        GROUP=group, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        NUM_SPLITS=S, DOT_PRECISION=dot_precision(q.dtype), HAS_SOFT_CAP=bool(logits_soft_cap),
        num_warps=num_warps,
    )
    if S > 1:
        _decode_stage2_kernel[(B, Hq)](
            mid_o, mid_lse, query_start_loc, out,
            *mid_o.stride(), *mid_lse.stride(), *out.stride(),
            D,
            NUM_SPLITS=S, BLOCK_S=triton.next_power_of_2(S), BLOCK_D=triton.next_power_of_2(D),
            num_warps=1 if D <= 64 else 2,
        )
    return out


__all__ = ["decode_attention", "default_num_kv_splits", "dot_precision", "soft_cap_arg", "soft_cap_tanh",
           "window_arg", "LOG2E"]
