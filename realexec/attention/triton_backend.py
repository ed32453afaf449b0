"""The `triton` attention backend: paged attention with the Triton kernels of realexec.kernels.

Same contract as the torch reference backend:

    forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], k_cache, v_cache, md, scale) -> [T, Hq, D]

1. store the new tokens' K/V into the cache at md.slot_mapping (-1 = skip);
2. decode-only batches (md.max_query_len == 1) use the GQA-packed split-KV decode kernel;
   every other batch (prefill, chunked prefill, prefix hits, mixed prefill + decode) uses the
   prefill/extend kernel, which reads prefix and new tokens alike from the cache;
3. with k_cache None (profiling run before the cache exists: whole prompts only) the
   prefill kernel runs over k/v themselves, viewed as a cache of one-token blocks.

Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (slow: tests only).

Per-layer options `sliding_window` and `logits_soft_cap` (see `check_layer_options`) run in
both kernels: no configuration falls back to the torch backend.

CUDA graphs: the decode path makes no host syncs and its grids depend only on
(num_seqs, heads, num_kv_splits); num_kv_splits is chosen from the batch size (a graph
bucket), the kv head count and the SM count, never from sequence lengths. Warm up once per
bucket before capture so Triton compiles outside the capture.
"""
from __future__ import annotations

import torch

from realexec.attention.metadata import AttentionMetadata, check_layer_options
from realexec.kernels import decode_attention, default_num_kv_splits, prefill_attention, store_kvcache


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_kv_splits: int | None = None, max_kv_splits: int = 16, **_unused) -> None:
        """num_kv_splits: fixed split count for decode (None = `default_num_kv_splits` per
        batch size). Extra keyword arguments (model shapes a factory may pass) are ignored:
        the kernels read every shape from the tensors."""
        self.num_kv_splits = num_kv_splits
        self.max_kv_splits = max_kv_splits
        self._num_sms: dict[torch.device, int] = {}

    def num_kv_splits_for(self, batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """Decode split count for a batch (bucket) size: shapes and device only, never data."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        if device not in self._num_sms:
            self._num_sms[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                                     if device.type == "cuda" else 4)
        return default_num_kv_splits(batch_size, num_kv_heads, self._num_sms[device], self.max_kv_splits)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, md: AttentionMetadata,
                scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]. Writes k/v into the cache first.

        With k_cache None (a profiling run before the cache exists) every sequence must be a
        whole prompt (context 0); it attends causally to its own new K/V only.
        """
        check_layer_options(sliding_window, logits_soft_cap)
        opts = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        out = torch.empty_like(q)
        num_seqs = md.seq_lens.shape[0]
        if k_cache is None:
            if q.shape[0] and num_seqs:
                self._prompts_without_cache(q, k, v, md, scale, out, opts)
            return out
        if k is not None and v is not None:
            store_kvcache(k, v, k_cache, v_cache, md.slot_mapping)
        if q.shape[0] == 0 or num_seqs == 0:
            return out
        if md.is_decode_only:
            splits = self.num_kv_splits_for(num_seqs, k_cache.shape[2], q.device)
            decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                             scale, num_kv_splits=splits, out=out, **opts)
        else:
            prefill_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                              md.max_query_len, scale, out=out, **opts)
        return out

    @staticmethod
    def _prompts_without_cache(q, k, v, md, scale, out, opts) -> None:
        """Whole prompts, no cache: view k/v [T, Hkv, D] as a cache of T one-token blocks
        ([T, 1, Hkv, D], no copy) whose block table for sequence b is its own rows
        query_start_loc[b] + j, and run the prefill kernel with context 0. Built on the
        device, no host sync; table entries past a sequence's length are never read."""
        qsl = md.query_start_loc
        query_lens = (qsl[1:] - qsl[:-1]).to(torch.int32)
        cols = torch.arange(max(md.max_query_len, 1), device=q.device, dtype=torch.int32)
        table = (qsl[:-1, None] + cols[None, :]).to(torch.int32)
        prefill_attention(q, k.unsqueeze(1), v.unsqueeze(1), table, query_lens, qsl,
                          md.max_query_len, scale, out=out, **opts)

    __call__ = forward


__all__ = ["TritonAttentionBackend"]
