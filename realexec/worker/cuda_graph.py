"""Decode through captured CUDA graphs, with one static-buffer/padding path for every device.

A decode step's shapes depend only on its batch size, so the runner keeps static input
buffers sized for the largest bucket, pads each decode batch up to the next bucket
(padding rows: token 0, position 0, slot -1 = "write nothing", seq_len 0, block table of
zeros) and, on CUDA, replays the graph captured for that bucket. On CPU (or with
`enforce_eager`) the very same padded buffers go through the model eagerly, so the
padding logic is exercised and tested everywhere; only capture/replay is CUDA-only.

Captured graphs need an attention backend whose launches depend only on shapes (the
Triton backend); the torch reference backend reads host-side lengths and is run eagerly.
"""
from __future__ import annotations

import torch

from realexec.attention.metadata import AttentionMetadata


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, then steps of 16 (vLLM-like), capped at max_batch."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max(max_batch, 1) + 16, 16))
    out = sorted({s for s in sizes if s < max_batch} | {max_batch})
    return [s for s in out if s >= 1]


class DecodeGraphRunner:
    def __init__(self, model, kv_caches, *, block_size: int, max_batch: int, max_blocks_per_seq: int,
                 max_seq_len: int, device: torch.device, capture: bool, buckets: list[int] | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        # `buckets` (benchmarks): capture only these batch sizes instead of decode_buckets'.
        self.buckets = sorted(set(buckets)) if buckets else decode_buckets(max_batch)
        self.max_seq_len = max_seq_len
        self.device = device
        b, w = self.buckets[-1], max_blocks_per_seq
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, w, dtype=torch.int32, device=device)
        self.capture_enabled = capture and device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} exceeds the largest graph bucket {self.max_batch}")

    def _metadata(self, b: int, seq_lens_cpu: list[int] | None) -> AttentionMetadata:
        # Under capture the host-side lengths are static upper bounds: a captured backend
        # must read lengths from the device tensors only.
        lens = seq_lens_cpu if seq_lens_cpu is not None else [self.max_seq_len] * b
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], block_size=self.block_size,
            max_query_len=1, max_seq_len=max(max(lens), 1), query_lens_cpu=[1] * b, seq_lens_cpu=lens)

    def _load(self, input_ids, positions, slot_mapping, seq_lens, block_tables) -> tuple[int, int]:
        """Copy a real batch into the static buffers and pad it to its bucket."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        w = block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            raise ValueError(f"block table of {w} blocks exceeds the runner's {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.seq_lens[:n].copy_(seq_lens)
        self.block_tables[:n, :w].copy_(block_tables)
        self.block_tables[:n, w:].zero_()
        if b > n:                                   # padding rows: harmless by construction
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].zero_()
            self.block_tables[n:b].zero_()
        return n, b

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture one graph per bucket (largest first, one shared memory pool)."""
        if not self.capture_enabled:
            return
        pool = None
        for b in reversed(self.buckets):
            md = self._metadata(b, None)
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, md)
            for _ in range(2):                      # compile kernels and settle the allocator
                self.model(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model(*args)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, seq_lens_cpu: list[int]) -> torch.Tensor:
        """Hidden states [n, H] of a decode batch of n <= max_batch sequences."""
        n, b = self._load(input_ids, positions, slot_mapping, seq_lens, block_tables)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            return self.outputs[b][:n]
        md = self._metadata(b, list(seq_lens_cpu) + [0] * (b - n))
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, md)[:n]
