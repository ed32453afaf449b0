"""Decode-attention benchmark: `python -m realexec.bench.kernels [--help]`.

On CUDA it prints one row per (batch size B, context length L) for SmolLM2-like heads
(9 query heads, 3 kv heads, head_dim 64, block size 16, fp16 by default):

  split   KV splits used (default_num_kv_splits for this B)
  us      decode_attention kernel time per call (stage 1 + merge), median of CUDA-event
          samples, each sample one replay of the call captured in a CUDA graph after flushing
          L2 (so KV comes from HBM): GPU time, as graph-replayed decode steps see it
  eager_us the same call launched from Python: at small shapes the host's launch cost
  GB/s    K+V bytes the call must read (2 * B * L * Hkv * D * elem) / time
  %copy   GB/s relative to a device-to-device copy measured in the same run, counted as
          (bytes read + bytes written) / time, i.e. the achievable DRAM bandwidth
  fwd_us  TritonAttentionBackend.forward (store_kvcache + decode) per call
  torch_us TorchAttentionBackend.forward on the same inputs, and ratio = torch_us / fwd_us

Without CUDA it prints one line saying so and exits 0. `--cpu-smoke` instead runs a tiny
configuration on the CPU under the Triton interpreter with wall-clock timing, to check the
script itself (numbers meaningless).

The timing helpers (`cuda_time_us`, `make_decode_inputs`) are meant to be reused for
further rows (e.g. CUDA-graph replay vs eager).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from realexec.attention.metadata import AttentionMetadata

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def cuda_time_us(fn, warmup: int = 10, reps: int = 50, flush_l2: bool = True, graph: bool = False) -> float:
    """Median GPU time of one fn() call in microseconds (CUDA events around each call).
    With flush_l2, a 256 MiB buffer is zeroed before every sample so inputs come from HBM.
    With graph, fn is captured once in a CUDA graph and each sample replays it: the time of
    the kernels alone, without the host's launch cost between the events (decode steps run
    this way); without it, a kernel shorter than its Python launch is timed as the launch."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
        torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def warm_up_clocks(seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while so its clocks leave their idle state before timing."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def wall_time_us(fn, warmup: int = 1, reps: int = 3, **_ignored) -> float:
    """CPU stand-in for cuda_time_us (used by --cpu-smoke)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def copy_bandwidth_gbs(device: torch.device, timer, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, (read + write bytes) / time, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src), warmup=3, reps=10, flush_l2=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def make_decode_inputs(batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A decode step of `batch` sequences of `seq_len` tokens (the new token included) over a
    shuffled (fragmented) paged cache. Returns a dict of tensors + AttentionMetadata."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    block_tables = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq]
    block_tables = block_tables.view(batch, blocks_per_seq).to(torch.int32)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    last = seq_len - 1  # the new token's position: its slot in each sequence's last block
    slots = block_tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    md = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), block_size=BLOCK_SIZE,
        max_query_len=1, max_seq_len=seq_len,
        query_lens_cpu=[1] * batch, seq_lens_cpu=[seq_len] * batch)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, md=md)


def _torch_backend():
    try:
        from realexec.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    except Exception as exc:  # missing or incompatible: the table says n/a
        print(f"(torch backend unavailable: {exc!r})")
        return None


def run(device: torch.device, dtype: torch.dtype, batch_sizes, seq_lens, timer, reps: int) -> list[dict]:
    from realexec.attention.triton_backend import TritonAttentionBackend
    from realexec.kernels.decode_attention import decode_attention

    scale = HEAD_DIM ** -0.5
    elem = torch.finfo(dtype).bits // 8
    triton_backend = TritonAttentionBackend()
    torch_backend = _torch_backend()
    copy_gbs = copy_bandwidth_gbs(device, timer, nbytes=(1 << 30) if device.type == "cuda" else (1 << 24))
    print(f"device-to-device copy: {copy_gbs:,.0f} GB/s (read + write)")
    header = (f"{'B':>4} {'L':>6} {'split':>5} {'us':>9} {'eager_us':>9} {'GB/s':>8} {'%copy':>6} "
              f"{'fwd_us':>9} {'torch_us':>9} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    rows = []
    for B in batch_sizes:
        for L in seq_lens:
            x = make_decode_inputs(B, L, dtype, device)
            md = x["md"]
            splits = triton_backend.num_kv_splits_for(B, NUM_KV_HEADS, device)
            out = torch.empty_like(x["q"])

            def kernel():
                decode_attention(x["q"], x["k_cache"], x["v_cache"], md.block_tables, md.seq_lens,
                                 md.query_start_loc, scale, num_kv_splits=splits, out=out)

            def triton_fwd():
                triton_backend.forward(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], md, scale)

            us = timer(kernel, reps=reps, graph=device.type == "cuda")
            eager_us = timer(kernel, reps=reps)
            fwd_us = timer(triton_fwd, reps=reps)
            kv_bytes = 2 * B * L * NUM_KV_HEADS * HEAD_DIM * elem
            gbs = kv_bytes / (us * 1e-6) / 1e9
            row = dict(B=B, L=L, splits=splits, us=us, eager_us=eager_us, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                       fwd_us=fwd_us, torch_us=None, ratio=None)
            if torch_backend is not None:
                def torch_fwd():
                    torch_backend.forward(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], md, scale)
                try:
                    row["torch_us"] = timer(torch_fwd, reps=max(5, reps // 5))
                    row["ratio"] = row["torch_us"] / fwd_us
                except Exception as exc:  # e.g. out of memory in the dense gather
                    print(f"(torch backend failed at B={B} L={L}: {exc!r})")
            rows.append(row)
            t_us = f"{row['torch_us']:9.1f}" if row["torch_us"] is not None else f"{'n/a':>9}"
            ratio = f"{row['ratio']:6.2f}" if row["ratio"] is not None else f"{'n/a':>6}"
            print(f"{B:>4} {L:>6} {splits:>5} {us:9.1f} {eager_us:9.1f} {gbs:8.1f} {row['pct_copy']:6.1f} "
                  f"{fwd_us:9.1f} {t_us} {ratio}", flush=True)
            x = out = None          # free this shape's tensors (the closures above still name them)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m realexec.bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="dtype of the KV cache and queries [fp16]")
    p.add_argument("--batch-sizes", default="1,8,64", help="comma-separated decode batch sizes [1,8,64]")
    p.add_argument("--seq-lens", default="512,2048,8192", help="comma-separated context lengths [512,2048,8192]")
    p.add_argument("--reps", type=int, default=50, help="timed samples per measurement [50]")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny CPU run under the Triton interpreter, to check the script itself")
    args = p.parse_args(argv)

    if args.cpu_smoke:
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print("CPU smoke run under the Triton interpreter: timings are meaningless.")
        run(torch.device("cpu"), torch.float32, [1, 2], [33], wall_time_us, reps=2)
        return 0
    if not torch.cuda.is_available():
        print("realexec.bench.kernels: CUDA is not available on this machine; nothing to benchmark "
              "(the kernels are tested on CPU under TRITON_INTERPRET=1 by tests/realexec/kernels/test_kernels.py).")
        return 0

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    warm_up_clocks()
    print(f"decode attention on {torch.cuda.get_device_name(device)}, {args.dtype}, "
          f"Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}")
    run(device, dtype, [int(b) for b in args.batch_sizes.split(",")],
        [int(n) for n in args.seq_lens.split(",")], cuda_time_us, reps=args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
