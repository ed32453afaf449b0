"""Where a worker sits in the parallel layout, and the communication it needs.

World = P pipeline stages x T tensor-parallel ranks; global rank = pp_rank * T + tp_rank.
  * `TPGroup`: the T ranks of one stage. The collectives a Megatron-style Llama needs
    (all-reduce of row-parallel outputs and of the vocab-parallel embedding; gather of
    vocab-sharded logits to the stage's driver, its tp_rank 0).
  * `PPGroup`: this rank's stage: which decoder layers it owns, and the point-to-point
    link to the same tp_rank of the previous and next stage, over which the hidden state
    of each step travels (every TP rank of a stage holds the whole hidden state after the
    all-reduce, so each sends its own copy to its counterpart: no gather, no scatter).
Only the last stage's TP driver (global rank (P - 1) * T) samples and answers a step.

One process (or Ray actor) per rank; `torch.distributed` does the communication: gloo on
CPU, NCCL on CUDA. The default process group spans the world (point-to-point sends use
it); with P > 1 every stage's TP ranks get a subgroup (created by every rank, same order).
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

# A collective that waits longer than this on a dead peer fails (the executor notices a
# dead worker far sooner; this only bounds a hang inside the group).
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class ParallelLayout:
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """global rank -> (pp_rank, tp_rank)."""
        return divmod(rank, self.tp)

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    @property
    def output_rank(self) -> int:
        """The rank that samples and answers each step: the last stage's TP driver."""
        return self.rank(self.pp - 1, 0)


class TPGroup:
    """The tensor-parallel ranks of one stage. `group` None: the default (whole-world) group."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, driver_global_rank: int = 0):
        self.rank = rank
        self.size = size
        self.group = group
        self.driver_global_rank = driver_global_rank

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """The driver's x on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=self.driver_global_rank, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on the driver; None on other ranks."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.driver_global_rank, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


class PPGroup:
    """This rank's pipeline stage: its decoder layers [start, end) and its neighbours."""

    def __init__(self, rank: int = 0, size: int = 1, layers: range = range(0), prev_rank: int | None = None,
                 next_rank: int | None = None):
        self.rank = rank
        self.size = size
        self.layers = layers
        self.prev_rank = prev_rank            # global rank of the previous stage's counterpart
        self.next_rank = next_rank
        self._sending: list = []              # (work, tensor) of the send still on the wire
        self.recv_wait_s = 0.0                # seconds blocked waiting for the previous stage
        self.send_wait_s = 0.0                # seconds blocked until the previous send was taken

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def send(self, h: torch.Tensor) -> None:
        """Hand this step's hidden state to the next stage without waiting for it to take
        it (it may still be busy with the previous batch); only the send before this one
        must have completed, so at most one batch waits on the wire per link."""
        t0 = time.perf_counter()
        self.wait_sent()
        self.send_wait_s += time.perf_counter() - t0
        h = h.contiguous()
        self._sending = [(dist.isend(h, dst=self.next_rank), h)]

    def wait_sent(self) -> None:
        for work, _ in self._sending:
            work.wait()
        self._sending = []

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's hidden state of this step ([num_tokens, hidden_size]). Steps
        arrive in order: every stage runs every step message in the order the engine sent them."""
        t0 = time.perf_counter()
        h = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(h, src=self.prev_rank)
        self.recv_wait_s += time.perf_counter() - t0
        return h


def stage_layer_ranges(num_layers: int, pp: int, partition: str | Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage (contiguous): `partition` ("10,10,10") when given,
    else an even split with the remainder on the earlier stages (the last stage also runs
    the final norm, the LM head and the sampler). The split and its checks are the core's
    (`core.config.pipeline_stage_layers`), shared with the simulator."""
    from core.config import pipeline_stage_layers
    ranges, start = [], 0
    for count in pipeline_stage_layers(num_layers, pp, partition):
        ranges.append(range(start, start + count))
        start += count
    return ranges


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
    experts_width = getattr(cfg, "moe_intermediate_size", 0)     # each expert's width is split too
    if getattr(cfg, "num_experts", 0) and experts_width % tp:
        raise ValueError(f"tensor-parallel-size {tp} must divide the expert MLP width {experts_width}")


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     layout: ParallelLayout | None = None,
                     stage_layers: list[range] | None = None) -> tuple[TPGroup, PPGroup]:
    """Join the default process group (no-op for one rank), create the stages' TP
    subgroups (P > 1), and return this rank's (TPGroup, PPGroup)."""
    layout = layout or ParallelLayout(1, world_size)
    if layout.world_size != world_size:
        raise ValueError(f"layout {layout.pp} x {layout.tp} does not match world size {world_size}")
    if world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    pp_rank, tp_rank = layout.coords(rank)
    group = None
    if layout.pp > 1 and layout.tp > 1:
        for k in range(layout.pp):                     # every rank creates every group, in order
            g = dist.new_group([layout.rank(k, t) for t in range(layout.tp)])
            if k == pp_rank:
                group = g
    tp = TPGroup(tp_rank, layout.tp, group, driver_global_rank=layout.rank(pp_rank, 0))
    layers = stage_layers[pp_rank] if stage_layers is not None else range(0)
    pp = PPGroup(pp_rank, layout.pp, layers,
                 prev_rank=layout.rank(pp_rank - 1, tp_rank) if pp_rank > 0 else None,
                 next_rank=layout.rank(pp_rank + 1, tp_rank) if pp_rank < layout.pp - 1 else None)
    return tp, pp


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
