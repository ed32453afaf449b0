"""Decode step time, CUDA graph replay vs eager: `python -m realexec.bench.graphs`.

Loads SmolLM2 (or --model) on CUDA with the Triton attention backend, fills a paged KV
cache to context L, and times one whole decode step (model forward for B sequences,
no sampling) at B in {1, 4, 16, 64}: eager vs replay of the captured graph for B's
bucket. Prints a table with the speed-up (target: graph >= 1.3x eager at batch 1).

Then mixed steps (realexec.worker.piecewise_graph): one prefill chunk of P tokens after a
cached prefix of L plus D decodes at context L, for P x D in --mixed (128x32, 128x64,
256x32, 256x64): the eager forward vs the piecewise runner (per-layer graphs around eager
attention) at the token bucket the engine would use, and the largest |difference| of
their hidden states.
Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m realexec.bench.graphs", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded SmolLM2)")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile'd decode graphs (the 'compiled ms' column)")
    p.add_argument("--mixed", default="128x32,128x64,256x32,256x64",
                   help="mixed steps PxD: a P-token prefill chunk plus D decodes ('' skips the table)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available on this machine: the graph-vs-eager benchmark needs a GPU (nothing run).")
        return 0

    from realexec.attention import AttentionMetadata
    from realexec.worker.cuda_graph import DecodeGraphRunner
    from realexec.bench.kernels import cuda_time_us
    from realexec.models.loader import load_model

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cuda")
    model, config, _ = load_model(args.model, dtype=dtype, device="cuda", attn_backend="triton")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bs, ctx = 16, args.context
    blocks_per_seq = ctx // bs + 1
    num_blocks = max(batches) * blocks_per_seq + 1
    shape = (num_blocks, bs, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape, dtype=dtype, device=dev), torch.randn(shape, dtype=dtype, device=dev))
              for _ in range(config.num_hidden_layers)]
    runner = DecodeGraphRunner(model, caches, block_size=bs, max_batch=max(batches),
                               max_blocks_per_seq=blocks_per_seq, max_seq_len=ctx + 1, device=dev, capture=True,
                               buckets=batches)
    runner.capture()
    compiled = None
    if not args.no_compile:
        import time

        from realexec.worker.compilation import compile_decode_forward
        t0 = time.perf_counter()
        compiled = DecodeGraphRunner(compile_decode_forward(model), caches, block_size=bs, max_batch=max(batches),
                                     max_blocks_per_seq=blocks_per_seq, max_seq_len=ctx + 1, device=dev,
                                     capture=True, buckets=batches)
        compiled.capture()
        print(f"compiled and captured {len(compiled.buckets)} buckets in {time.perf_counter() - t0:.1f} s")
    print(f"{config.architecture}, {args.dtype}, context {ctx}, {torch.cuda.get_device_name()}")
    print(f"{'batch':>6} {'eager ms':>10} {'graph ms':>10} {'speed-up':>9}"
          + ("" if compiled is None else f" {'compiled ms':>12} {'vs graph':>9} {'max |diff|':>11}"))
    for b in batches:
        tables = torch.arange(1, 1 + b * blocks_per_seq, dtype=torch.int32, device=dev).view(b, blocks_per_seq)
        ids = torch.randint(0, config.vocab_size, (b,), device=dev)
        pos = torch.full((b,), ctx, dtype=torch.int64, device=dev)
        slots = (tables[:, ctx // bs].long() * bs + ctx % bs)
        lens = torch.full((b,), ctx + 1, dtype=torch.int32, device=dev)
        md = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                               seq_lens=lens, block_tables=tables, block_size=bs, max_query_len=1,
                               max_seq_len=ctx + 1, query_lens_cpu=[1] * b, seq_lens_cpu=[ctx + 1] * b)
        with torch.inference_mode():
            eager = cuda_time_us(lambda: model(ids, pos, caches, md), reps=args.reps, flush_l2=False)
            graph = cuda_time_us(lambda: runner.run(ids, pos, slots, lens, tables, [ctx + 1] * b),
                                 reps=args.reps, flush_l2=False)
        row = f"{b:>6} {eager / 1000:>10.3f} {graph / 1000:>10.3f} {eager / graph:>8.2f}x"
        if compiled is not None:
            with torch.inference_mode():
                comp = cuda_time_us(lambda: compiled.run(ids, pos, slots, lens, tables, [ctx + 1] * b),
                                    reps=args.reps, flush_l2=False)
                # The same step through both graphs (slots -1: the cache is left as it is).
                none = torch.full_like(slots, -1)
                want = runner.run(ids, pos, none, lens, tables, [ctx + 1] * b).float()
                got = compiled.run(ids, pos, none, lens, tables, [ctx + 1] * b).float()
            row += f" {comp / 1000:>12.3f} {graph / comp:>8.2f}x {(got - want).abs().max().item():>11.2e}"
        print(row)
    print("target: graph >= 1.3x eager at batch 1", flush=True)
    if args.mixed:
        mixed_steps(model, config, dtype, ctx, [tuple(map(int, c.split("x"))) for c in args.mixed.split(",")],
                    args.reps)
    return 0


def mixed_steps(model, config, dtype, ctx: int, cases: list[tuple[int, int]], reps: int,
                device: str = "cuda") -> None:
    """The mixed-step table: eager forward vs piecewise graphs, one row per (chunk, decodes).
    (device "cpu": the tests' smoke run of the table's batches, nothing captured.)"""
    from realexec.attention import AttentionMetadata
    from realexec.bench import kernels
    from realexec.worker.piecewise_graph import PiecewiseGraphRunner, token_buckets

    dev, bs = torch.device(device), 16
    engine_buckets = token_buckets(2048)
    bucket = {p + d: min(b for b in engine_buckets if b >= p + d) for p, d in cases}
    width = (ctx + max(p for p, _ in cases)) // bs + 1          # blocks per sequence
    seqs = 1 + max(d for _, d in cases)
    shape = (seqs * width + 1, bs, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape, dtype=dtype, device=dev), torch.randn(shape, dtype=dtype, device=dev))
              for _ in range(config.num_hidden_layers)]
    runner = PiecewiseGraphRunner(model, max_tokens=max(bucket.values()), device=dev, capture=True,
                                  buckets=sorted(set(bucket.values())))
    runner.capture()
    print(f"\nmixed steps: one P-token prefill chunk after {ctx} cached tokens + D decodes at context {ctx}, "
          f"piecewise graphs ({runner.num_pieces} pieces per bucket) vs eager")
    print(f"{'P x D':>9} {'tokens':>7} {'bucket':>7} {'eager ms':>10} {'piecewise ms':>13} {'speed-up':>9} "
          f"{'max |diff|':>11}", flush=True)
    for p, d in cases:
        qlens, lens = [p] + [1] * d, [ctx + p] + [ctx + 1] * d
        tables = torch.arange(1, 1 + (d + 1) * width, dtype=torch.int32, device=dev).view(d + 1, width)
        pos = torch.cat([torch.arange(ctx, ctx + p, device=dev), torch.full((d,), ctx, device=dev)])
        row_of = torch.cat([torch.zeros(p, dtype=torch.long, device=dev), torch.arange(1, d + 1, device=dev)])
        slots = tables[row_of, pos // bs].long() * bs + pos % bs
        starts = torch.tensor([0] + [p + i for i in range(d + 1)], dtype=torch.int32, device=dev)
        md = AttentionMetadata(slot_mapping=slots, query_start_loc=starts,
                               seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=tables,
                               block_size=bs, max_query_len=p, max_seq_len=max(lens), query_lens_cpu=qlens,
                               seq_lens_cpu=lens)
        ids = torch.randint(0, config.vocab_size, (p + d,), device=dev)
        with torch.inference_mode():
            eager = kernels.cuda_time_us(lambda: model(ids, pos, caches, md), reps=reps, flush_l2=False)
            piecewise = kernels.cuda_time_us(lambda: runner.run(ids, pos, caches, md), reps=reps, flush_l2=False)
            want = model(ids, pos, caches, md).float()
            got = runner.run(ids, pos, caches, md).float()
        print(f"{f'{p}x{d}':>9} {p + d:>7} {bucket[p + d]:>7} {eager / 1000:>10.3f} {piecewise / 1000:>13.3f} "
              f"{eager / piecewise:>8.2f}x {(got - want).abs().max().item():>11.2e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())


# `python -m realexec bench kernels`: the kernel table, then graph vs eager.
def add_kernels_arguments(parser) -> None:
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"],
                        help="dtype of the attention tensors (bandwidth table) and of the model "
                             "(graph-vs-eager table) [fp16]")
    parser.add_argument("--reps", type=int, default=50, help="timed repetitions of each measurement [50]")
    parser.add_argument("--model", default=None, help="HF dir or GGUF for the graph-vs-eager rows "
                                                      "(default: embedded SmolLM2)")


def run_kernels(args) -> int:
    from realexec.bench.kernels import main as kernels_main
    rc = kernels_main(["--dtype", args.dtype, "--reps", str(args.reps)])
    model = ["--model", args.model] if args.model else []
    return rc or main(["--dtype", args.dtype, "--reps", str(args.reps), *model])
