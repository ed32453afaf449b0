"""Whole-block operations on the paged KV cache: copy-on-write copies and swap in/out.

These are plain torch indexing/copies, not Triton kernels: each is a bulk move of whole
blocks (block_size * num_kv_heads * head_dim contiguous elements), which torch's copy
kernels already do at memory bandwidth, and they run at most once per engine step (CoW
copies are rare; swaps are the slow path by design). Keeping them in torch also keeps them
working on any device.

`src_dst` / `mapping` are [N, 2] integer tensors (or lists of pairs): column 0 = source
block id, column 1 = destination block id. Destinations must be unique.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def _as_pairs(src_dst, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = torch.as_tensor(src_dst, dtype=torch.int64).reshape(-1, 2)
    pairs = pairs.to(device, non_blocking=True)
    return pairs[:, 0], pairs[:, 1]


def _flatten_caches(kv_caches: Iterable) -> list[torch.Tensor]:
    """Accept [k0, v0, k1, v1, ...], [(k0, v0), (k1, v1), ...] or a stacked tensor
    [L, 2, num_blocks, ...] / [L, num_blocks, ...]; return a flat list of block-major tensors."""
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() == 6:                 # [L, 2, num_blocks, block_size, H, D]
            return [kv_caches[l, i] for l in range(kv_caches.shape[0]) for i in range(2)]
        return [kv_caches[l] for l in range(kv_caches.shape[0])]
    flat: list[torch.Tensor] = []
    for item in kv_caches:
        if isinstance(item, torch.Tensor):
            flat.append(item)
        else:
            flat.extend(item)
    return flat


def copy_blocks(kv_caches, src_dst) -> None:
    """Copy-on-write: for every layer's K and V cache, cache[dst] = cache[src] for each pair.

    kv_caches: K and V caches of all layers ([num_blocks, block_size, H, D] each), as a flat
    list, a list of (k, v) pairs, or a stacked tensor. All reads of one cache happen before
    its writes (gather, then scatter), so a block may be both a source and a destination.
    No host synchronisation (the pair tensor is moved to the device asynchronously).
    """
    caches = _flatten_caches(kv_caches)
    if not caches:
        return
    src, dst = _as_pairs(src_dst, caches[0].device)
    if src.numel() == 0:
        return
    for cache in caches:
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                mapping: Sequence[Sequence[int]] | torch.Tensor) -> None:
    """Copy blocks between two caches of one layer, possibly on different devices
    (swap-out GPU -> CPU, swap-in CPU -> GPU): dst_cache[d] = src_cache[s] for each (s, d).

    Same device: one gather + scatter. Across devices: one `copy_(non_blocking=True)` per
    block, a contiguous slice of both caches, so with a *pinned* CPU cache each copy is a
    direct async DMA on the current stream (no staging through pageable memory; with a
    pageable CPU cache the copies are still correct but synchronous). The caller must
    synchronise the stream before reading swapped-out blocks on the host, or before
    reusing a swapped-in source block. `mapping` should live on the CPU (or be a list)
    for the cross-device path; it is read on the host.
    """
    if src_cache.device == dst_cache.device:
        src, dst = _as_pairs(mapping, src_cache.device)
        if src.numel():
            dst_cache.index_copy_(0, dst, src_cache.index_select(0, src))
        return
    pairs = mapping.tolist() if isinstance(mapping, torch.Tensor) else mapping
    for s, d in pairs:
        dst_cache[int(d)].copy_(src_cache[int(s)], non_blocking=True)


__all__ = ["copy_blocks", "swap_blocks"]
