"""What one forward pass needs to know about the paged KV cache.

A step's batch is flattened: the new (query) tokens of every scheduled sequence are
concatenated, prefills (possibly chunked, possibly after a prefix-cache hit) and
decodes alike, in the order of `query_start_loc`. Attention backends (torch
reference, Triton) read only this object plus the per-layer cache tensors
`k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: flat cache slot (block_id * block_size + offset) where each new
    # token's K/V is written; -1 means "do not write" (padding rows).
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: new tokens of sequence i are rows query_start_loc[i]:query_start_loc[i+1].
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length after this step (cached prefix + new tokens).
    # A padded row has seq_len 0 and query length 0 (decode padding may use query length 1
    # with slot -1; its output is garbage and ignored).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: physical block ids; entries past a sequence's
    # last block are padding (0) and must never be read (mask by seq_lens).
    block_tables: torch.Tensor
    block_size: int
    # Host-side ints, so backends never sync to learn shapes.
    max_query_len: int
    max_seq_len: int
    # Python-side copies (lists) of query lengths and seq lens, for the torch backend's
    # per-sequence loops without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def check_layer_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """Validate a layer's attention options (what every backend's forward accepts):
    sliding_window W: each query attends to the last W positions, itself included (keys
    at positions p - W < j <= p; HF's `kv_idx > q_idx - sliding_window`, Mistral and
    Gemma 2 alike); logits_soft_cap c: scaled scores s become c * tanh(s / c) before the
    mask and softmax (Gemma 2). None turns either off."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not (logits_soft_cap > 0 and logits_soft_cap != float("inf")):
        raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap!r}")
