"""Write the new tokens' K/V rows into the paged cache.

One program per new token. The program loads the token's whole [num_kv_heads, head_dim]
K (and V) tile, turns its flat slot into (block, offset) and stores the tile at
cache[block, offset, :, :]. A slot of -1 (padding row) masks every load and store, so
the cache row is left untouched and nothing is read from the padding token either.

All strides are passed explicitly, so any strided view works (Triton specializes a
stride of 1, so the contiguous case costs nothing extra). Block ids are widened to
int64 before being multiplied by the block stride: a large cache overflows int32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr,                      # new rows: [T, H, D]
    k_cache_ptr, v_cache_ptr,          # caches: [num_blocks, block_size, H, D]
    slot_ptr,                          # [T] int64, -1 = skip
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    block_size, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    # For slot == -1 these are meaningless, but every access below is masked by `valid`.
    block = slot // block_size
    offset = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A skipped token gets a head limit of 0, which masks its whole tile. (Scalar masks are
    # folded into a block comparison rather than AND-ed with a block: same on the GPU, and
    # the interpreter mis-types `block_mask & scalar_mask`.)
    heads_to_write = tl.where(valid, num_heads, 0)
    mask = (offs_h[:, None] < heads_to_write) & (offs_d[None, :] < head_dim)

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    kc = (k_cache_ptr + block * stride_kcb + offset * stride_kcs
          + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd)
    vc = (v_cache_ptr + block * stride_vcb + offset * stride_vcs
          + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [T] integer (int64 preferred), -1 = do not write. In place; no host sync.

    Slots must be unique among the non-negative entries (two tokens writing the same slot
    race). Launch grid = (T,), so it is CUDA-graph capturable for a fixed T.
    """
    T, H, D = k.shape
    assert v.shape == k.shape, (k.shape, v.shape)
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (H, D), (k_cache.shape, k.shape)
    assert v_cache.shape == k_cache.shape
    assert slot_mapping.shape[0] == T, (slot_mapping.shape, T)
    if T == 0:
        return
    block_size = k_cache.shape[1]
    _store_kvcache_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        block_size, H, D,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
    )
