"""Attention backends over the paged KV cache.

A backend is an object with
    forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], k_cache, v_cache,
            md: AttentionMetadata, scale: float) -> out [T, Hq, D]
that first writes k/v into the cache at md.slot_mapping, then attends each sequence's
new queries to its whole context read through its block table.
"""
from __future__ import annotations

from .metadata import AttentionMetadata

BACKENDS = ("torch", "cpu", "triton")


def get_attention_backend(name: str = "torch"):
    """A backend instance by name: "torch" (the reference, any device), "cpu" (the
    batched C++ kernel, compiled on first use), "triton" (CUDA; imported lazily: it needs
    triton + CUDA or TRITON_INTERPRET=1)."""
    if name == "cpu":
        from .cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend()
    if name == "torch":
        from .torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from .triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")


__all__ = ["AttentionMetadata", "get_attention_backend", "BACKENDS"]
