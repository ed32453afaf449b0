"""Tensor-parallel group of one worker: its rank, the degree, and the two collectives the
Megatron-style Llama needs (all-reduce of row-parallel outputs and of the vocab-parallel
embedding; gather of vocab-sharded logits to the driver).

One process (or Ray actor) per rank; `torch.distributed` does the communication: gloo on
CPU, NCCL on CUDA. The group is the default process group, created by `init_distributed`.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# A collective that waits longer than this on a dead peer fails (the executor notices a
# dead worker far sooner; this only bounds a hang inside the group).
COLLECTIVE_TIMEOUT_S = 120


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1):
        self.rank = rank
        self.size = size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0; None on other ranks."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


def check_tensor_parallel(cfg, tp: int) -> None:
    """Heads split evenly: each rank holds num_heads / tp query heads and num_kv_heads / tp
    KV heads (KV heads are not replicated: fewer KV heads than ranks is refused)."""
    if tp < 1:
        raise ValueError(f"tensor-parallel-size must be >= 1, got {tp}")
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if h % tp or kv % tp:
        divisors = [d for d in range(1, kv + 1) if kv % d == 0 and h % d == 0]
        raise ValueError(
            f"tensor-parallel-size {tp} must divide the model's {h} query heads and {kv} KV heads "
            f"(each rank holds an equal share of both; KV heads are not replicated); "
            f"valid sizes: {', '.join(map(str, divisors))}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor-parallel-size {tp} must divide the MLP width {cfg.intermediate_size}")


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the default process group (no-op for one rank)."""
    if world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TPGroup(rank, world_size)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
