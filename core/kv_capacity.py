"""KV-cache capacity per tensor-parallel rank: one arithmetic for the real executor's
workers and the simulator's sizing.

Each rank of a tensor-parallel group holds its share of every block's KV heads (the
same block ids on every rank: one scheduler owns them), so a block costs
2 (K and V) * layers * ceil(kv_heads / tp) * head_dim * dtype bytes * block_size on a
rank, and the engine can use the smallest count any rank affords. When tp exceeds the
KV heads, heads are replicated (the ceil); the real executor refuses that case earlier.
"""
from __future__ import annotations


def kv_heads_per_rank(num_kv_heads: int, tp: int = 1) -> int:
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    return -(-num_kv_heads // tp)


def kv_block_bytes_per_rank(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                            dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of one KV block (K and V, every layer) on one rank."""
    return 2 * num_layers * kv_heads_per_rank(num_kv_heads, tp) * head_dim * dtype_bytes * block_size


def kv_blocks_per_rank(memory_bytes: float, block_size: int, num_layers: int, num_kv_heads: int,
                       head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """How many KV blocks fit in `memory_bytes` of one rank (0 if none)."""
    per_block = kv_block_bytes_per_rank(block_size, num_layers, num_kv_heads, head_dim, dtype_bytes, tp)
    return max(0, int(memory_bytes // per_block))
