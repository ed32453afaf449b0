"""KV-cache capacity per tensor-parallel rank: one arithmetic for the real executor's
workers and the simulator's sizing.

Each rank of a tensor-parallel group holds its share of every block's KV heads (the
same block ids on every rank: one scheduler owns them), so a block costs
2 (K and V) * layers * ceil(kv_heads / tp) * head_dim * dtype bytes * block_size on a
rank, and the engine can use the smallest count any rank affords. When tp exceeds the
KV heads, heads are replicated (the ceil); the real executor refuses that case earlier.

With pipeline parallelism a rank holds the KV of its stage's layers only (same block ids
on every stage too), so `num_layers` is the stage's layer count and the engine's budget is
the minimum over stages (`kv_blocks_per_pipeline`).
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


def kv_blocks_per_pipeline(memory_bytes: float | list[float], block_size: int, stage_layers: list[int],
                           num_kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """KV blocks the whole pipeline can use: the minimum over stages of what one rank of
    that stage affords. `memory_bytes`: the KV memory of a rank, the same for every stage
    or one value per stage (stages differ in weights: the first holds the embedding, the
    last the LM head)."""
    if not stage_layers:
        raise ValueError("a pipeline needs at least one stage")
    memory = memory_bytes if isinstance(memory_bytes, list) else [memory_bytes] * len(stage_layers)
    if len(memory) != len(stage_layers):
        raise ValueError(f"{len(memory)} memory budgets for {len(stage_layers)} stages")
    return min(kv_blocks_per_rank(m, block_size, layers, num_kv_heads, head_dim, dtype_bytes, tp)
               for m, layers in zip(memory, stage_layers))
