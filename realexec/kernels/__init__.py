"""Triton kernels for the paged KV cache.

Public API (all take/return torch tensors; see each module for details):

    store_kvcache(k, v, k_cache, v_cache, slot_mapping)            # store_kvcache.py
    decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                     query_start_loc, scale, num_kv_splits, out=None) # decode_attention.py
    default_num_kv_splits(batch_size, num_kv_heads, num_sms)         # decode_attention.py
    prefill_attention(q, k_cache, v_cache, block_tables, seq_lens,
                      query_start_loc, max_query_len, scale, out=None) # prefill_attention.py
    copy_blocks(kv_caches, src_dst)                                  # block_ops.py (torch)
    swap_blocks(src_cache, dst_cache, mapping)                       # block_ops.py (torch)

Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim],
flat slot = block_id * block_size + offset.

Import discipline. Triton decides at *decoration* time (when a kernel module is first
imported) whether `@triton.jit` builds a GPU kernel or an interpreter function, by reading
TRITON_INTERPRET. So:
  * this package imports no kernel module eagerly; names are resolved lazily by
    `__getattr__`, so `import realexec.kernels` (or `realexec`) never imports triton;
  * on a machine without CUDA, importing this package sets TRITON_INTERPRET=1 unless the
    variable is already set, because a compiled Triton kernel cannot run there anyway.
    Tests set it explicitly at the top of the test file before importing anything.
"""
from __future__ import annotations

import importlib
import os


def _default_to_interpreter_without_cuda() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        has_cuda = False
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"


_default_to_interpreter_without_cuda()


def interpreter_active() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_EXPORTS = {
    "store_kvcache": "store_kvcache",
    "decode_attention": "decode_attention",
    "default_num_kv_splits": "decode_attention",
    "prefill_attention": "prefill_attention",
    "copy_blocks": "block_ops",
    "swap_blocks": "block_ops",
}

__all__ = sorted(_EXPORTS) + ["interpreter_active"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value
