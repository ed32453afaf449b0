"""CPU attention and matmul micro-benchmarks: `python -m realexec.bench.cpu_attention {attn,linear,e2e}`.

Built for a shared, noisy CPU: every comparison runs the variants in the same process,
alternating round by round, and reports the median per variant plus the ratio of
medians; the load average is printed next to the numbers.

  attn    one layer's attention call (K/V write included) on SmolLM2 shapes (9 query heads,
          3 KV heads, head_dim 64, block size 16), for step shapes the scheduler makes: a
          decode batch of N sequences with ShareGPT-like context lengths, and a mixed step
          (prefills + prefill chunk + decodes) of about the token budget. Variants: the
          torch reference (`torch`) and the C++ kernel (`cpu`, per --tile-rows).
  linear  GFLOP/s of SmolLM2's projections (fused qkv, o, fused gate/up, down, LM head) at
          given token counts, as F.linear (MKL sgemm via oneDNN), as oneDNN with weights
          pre-packed (torch.ops.mkldnn._linear_pointwise) and as MKL packed sgemm
          (torch.ops.mkl._mkl_linear), against the machine's FLOP peak measured as a
          large square sgemm.
  step    one model forward (+ logits of one row per sequence) of SmolLM2-135M on a decode
          step of --decode-batch sequences and on a mixed step, with attention by `torch`,
          `cpu`, and `none` (attention skipped: the rest of the step, so step - none is
          the attention's share).
  e2e     whole engine on trace requests, all submitted at once, greedy, ignore_eos:
          output tok/s per engine configuration (--variant NAME:key=value,...), alternating.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

from realexec.attention.metadata import AttentionMetadata

HQ, HKV, D, BS = 9, 3, 64, 16


def load() -> str:
    try:
        return "load avg " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load avg ?"


def sharegpt_like_lengths(n: int, rng: random.Random) -> list[int]:
    """Context lengths of decoding sequences mid-run: prompt (~lognormal, median ~200) + output so far."""
    return [min(2000, int(rng.lognormvariate(5.3, 0.8)) + rng.randint(1, 200)) for _ in range(n)]


def make_step(specs: list[tuple[int, int]], seed: int = 0):
    """[(context_len, query_len)] -> (q, k, v, k_cache, v_cache, metadata) with shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // BS) for c, n in specs]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables, slots, starts, lens, at = [], [], [0], [], 0
    for (c, n), nb in zip(specs, need):
        t = perm[at:at + nb].tolist()
        at += nb
        tables.append(t)
        slots.extend(t[p // BS] * BS + p % BS for p in range(c, c + n))
        starts.append(starts[-1] + n)
        lens.append(c + n)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    T = starts[-1]
    md = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                           torch.tensor(lens, dtype=torch.int32), bt, BS, max(n for _, n in specs), max(lens),
                           [n for _, n in specs], lens)
    kc = torch.randn(num_blocks, BS, HKV, D, generator=g)
    vc = torch.randn(num_blocks, BS, HKV, D, generator=g)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g)
    q = qkv[:, :HQ * D].reshape(T, HQ, D).contiguous()
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(T, HKV, D)
    return q, k, v, kc, vc, md


CLOCK = time.perf_counter


def alternate(variants: dict, rounds: int, reps: int) -> dict[str, list[float]]:
    """{name: fn} -> {name: [seconds per call, one per round]}, variants interleaved.
    With --clock cpu the seconds are this process's CPU time (all its threads): on a
    machine others load, the work done rather than the share of the cores received."""
    times = {name: [] for name in variants}
    for fn in variants.values():      # warm-up (builds, first-touch)
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = CLOCK()
            for _ in range(reps):
                fn()
            times[name].append((CLOCK() - t0) / reps)
    return times


def report(title: str, times: dict[str, list[float]], base: str, unit: float = 1e6, unit_name: str = "us") -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    cells = "  ".join(f"{k} {med[k] * unit:9.1f} {unit_name}" for k in times)
    ratios = "  ".join(f"{base}/{k} {med[base] / med[k]:5.2f}x" for k in times if k != base)
    print(f"{title:<34} {cells}  {ratios}", flush=True)


def run_attn(args) -> None:
    from realexec.attention.cpu_backend import CpuAttentionBackend
    from realexec.attention.torch_backend import TorchAttentionBackend

    rng = random.Random(0)
    shapes = {}
    for n in args.decode_batch:
        shapes[f"decode x{n}"] = [(c, 1) for c in sharegpt_like_lengths(n, rng)]
    prompts = [int(rng.lognormvariate(5.3, 0.8)) + 8 for _ in range(40)]
    mixed, budget = [], args.token_budget
    for c in sharegpt_like_lengths(32, rng):      # 32 decodes, then prompts until the budget is full
        mixed.append((c, 1))
    used = len(mixed)
    for p in prompts:
        take = min(p, budget - used)
        if take <= 0:
            break
        mixed.append((0, take))
        used += take
    mixed.append((300, 64))                        # a chunk after a cached context
    shapes[f"mixed {used + 64} tokens"] = mixed
    if args.prefill_tokens:                        # a prefill-only step: the trace's first prompts
        from traces import load_trace
        prefill, used = [], 0
        for r in load_trace(args.trace):
            take = min(r.prompt_len, args.prefill_tokens - used)
            if take <= 0:
                break
            prefill.append((0, take))
            used += take
        shapes[f"prefill {used} tok, {len(prefill)} prompts"] = prefill
    print(f"attention, one layer (SmolLM2 heads {HQ}/{HKV}x{D}, block {BS}), threads {torch.get_num_threads()}, "
          f"{args.clock} clock, {load()}")
    backends = {"torch": TorchAttentionBackend()}
    for tr in args.tile_rows:
        backends[f"cpu{tr}"] = CpuAttentionBackend(tile_rows=tr)
    for name, specs in shapes.items():
        q, k, v, kc, vc, md = make_step(specs)
        fns = {b: (lambda be=be: be.forward(q, k, v, kc, vc, md, D ** -0.5)) for b, be in backends.items()}
        report(name, alternate(fns, args.rounds, args.reps), "torch")


class _NoAttention:
    """Writes nothing, returns zeros: times the rest of a step (not a correct model)."""
    name = "none"

    def forward(self, q, k, v, k_cache, v_cache, md, scale):
        return torch.zeros_like(q)


def run_step(args) -> None:
    from realexec.models.loader import load_model
    from realexec.attention.cpu_backend import CpuAttentionBackend
    from realexec.attention.torch_backend import TorchAttentionBackend

    model, cfg, _ = load_model(None, torch.float32, "cpu", attn_backend="torch", with_tokenizer=False)
    rng = random.Random(0)
    steps = {f"decode x{n}": [(c, 1) for c in sharegpt_like_lengths(n, rng)] for n in args.decode_batch}
    mixed = [(c, 1) for c in sharegpt_like_lengths(32, rng)]
    mixed += [(0, min(400, int(rng.lognormvariate(5.3, 0.8)) + 8)) for _ in range(2)] + [(300, 64)]
    steps[f"mixed {sum(n for _, n in mixed)} tokens"] = mixed
    backends = {"torch": TorchAttentionBackend(), "cpu": CpuAttentionBackend(), "none": _NoAttention()}
    print(f"model step, SmolLM2-135M fp32, threads {torch.get_num_threads()}, {args.clock} clock, {load()}")
    for title, specs in steps.items():
        _, _, _, _, _, md = make_step(specs)
        num_blocks = md.block_tables.max().item() + 1
        shape = (num_blocks, BS, cfg.num_key_value_heads, cfg.head_dim)
        caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(cfg.num_hidden_layers)]
        T = md.slot_mapping.shape[0]
        ids = torch.randint(0, cfg.vocab_size, (T,))
        positions = torch.cat([torch.arange(c, c + n) for c, n in specs])
        last = md.query_start_loc[1:].long() - 1

        def fwd(backend):
            for layer in model.layers:
                layer.self_attn.backend = backend
            h = model(ids, positions, caches, md)
            return model.compute_logits(h[last])

        fns = {name: (lambda b=b: fwd(b)) for name, b in backends.items()}
        times = alternate(fns, args.rounds, 1)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{title:<22} step ms: " + "  ".join(f"{k} {1e3 * med[k]:7.1f}" for k in med)
              + f"  | attention ms: torch {1e3 * (med['torch'] - med['none']):6.1f}  cpu "
              f"{1e3 * (med['cpu'] - med['none']):6.1f}  | step torch/cpu {med['torch'] / med['cpu']:.2f}x",
              flush=True)


# SmolLM2-135M projections (out_features, in_features): fused qkv, o, fused gate/up, down, LM head.
LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def run_linear(args) -> None:
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    peak = alternate({"mm": lambda: torch.mm(a, b)}, 7, 2)["mm"]
    peak_gflops = 2 * n ** 3 / min(peak) / 1e9       # best sample: the machine's attainable peak
    print(f"linear layers, threads {torch.get_num_threads()}, {args.clock} clock, {load()}; "
          f"peak = best {n}^3 sgemm: {peak_gflops:.1f} GFLOP/s")
    print(f"{'layer':<8} {'tokens':>6}  " + "  ".join(f"{v:>22}" for v in args.linear_variants))
    for tokens in args.tokens:
        for name, (out_f, in_f) in LINEARS.items():
            if name == "lm_head" and tokens > 256:
                continue
            w, bias = torch.randn(out_f, in_f), None
            x = torch.randn(tokens, in_f)
            fns = {}
            for variant in args.linear_variants:
                if variant == "linear":
                    fns[variant] = lambda: F.linear(x, w)
                elif variant == "mkldnn_packed":
                    packed = torch.ops.mkldnn._reorder_linear_weight(w, tokens)
                    fns[variant] = lambda p=packed: torch.ops.mkldnn._linear_pointwise(x, p, bias, "none", [], "")
                elif variant == "mkl_packed":
                    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, tokens)
                    fns[variant] = lambda p=packed: torch.ops.mkl._mkl_linear(x, p, w, bias, tokens)
                else:
                    raise ValueError(f"unknown linear variant {variant!r}")
            ref = F.linear(x, w)
            for fn in fns.values():
                torch.testing.assert_close(fn(), ref, atol=1e-3, rtol=1e-4)
            reps = max(1, int(2e8 / (2 * tokens * out_f * in_f)))
            times = alternate(fns, args.rounds, reps)
            flops = 2 * tokens * out_f * in_f
            cells = "  ".join(f"{flops / statistics.median(times[v]) / 1e9:7.1f} GF/s {100 * flops / statistics.median(times[v]) / 1e9 / peak_gflops:5.1f}%    "
                              for v in fns)
            print(f"{name:<8} {tokens:>6}  {cells}", flush=True)


def run_e2e(args) -> None:
    from core import SamplingParams
    from realexec.bench.throughput import fit_requests
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine
    from traces import load_trace

    trace = [r for r in load_trace(args.trace) if r.prompt_len >= args.min_prompt_len][:args.num_requests]
    if not trace:
        raise SystemExit(f"{args.trace}: no request has a prompt of >= {args.min_prompt_len} tokens")
    engines = {}
    for spec in args.variant:
        name, _, kvs = spec.partition(":")
        kwargs = {}
        for kv in filter(None, kvs.split(",")):
            key, _, value = kv.partition("=")
            field = EngineArgs.__dataclass_fields__[key.replace("-", "_")]
            kwargs[field.name] = (value.lower() in ("1", "true", "yes")) if field.type in ("bool", bool) else (
                type(field.default)(value) if field.default is not None else (
                    float(value) if "memory" in key else int(value) if value.isdigit() else value))
        engines[name] = LLMEngine(EngineArgs(**{"cpu_threads": args.threads, **kwargs}))
    ns = argparse.Namespace(max_tokens_cap=args.max_tokens_cap)
    requests = fit_requests(ns, trace, next(iter(engines.values())))
    print(f"e2e: {len(requests)} requests, mean prompt {statistics.mean(len(i) for i, _ in requests):.0f}, "
          f"{sum(m for _, m in requests)} output tokens, threads {args.threads}, {args.clock} clock "
          f"(cpu: output tokens per CPU-second of this process; the uni executor runs in it), {load()}", flush=True)
    outputs, rates = {}, {name: [] for name in engines}
    try:
        for r in range(args.rounds):
            for name, engine in engines.items():
                for i, (ids, m) in enumerate(requests):
                    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
                                       request_id=f"{r}-{i}")
                toks, t0, got = 0, CLOCK(), {}
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            got[out.request_id.split("-", 1)[1]] = out.outputs[0].token_ids
                            toks += sum(len(c.token_ids) for c in out.outputs)
                rates[name].append(toks / (CLOCK() - t0))
                outputs.setdefault(name, got)
                print(f"  round {r} {name:<12} {rates[name][-1]:7.1f} tok/s  ({load()})", flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    base = next(iter(engines))
    for name in engines:
        same = sum(outputs[name][k] == outputs[base][k] for k in outputs[base])
        print(f"{name:<12} median {statistics.median(rates[name]):7.1f} tok/s  "
              f"ratio to {base} {statistics.median(rates[name]) / statistics.median(rates[base]):5.2f}x  "
              f"greedy outputs equal to {base}'s: {same}/{len(outputs[base])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m realexec.bench.cpu_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["attn", "step", "linear", "e2e"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or the process's CPU time (robust to other load; "
                             "with --threads 1 it is the kernel's single-core time)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=2048,
                        help="attn: also a prefill-only step of the --trace's first prompts up to this many "
                             "tokens (2048: 38 ShareGPT prompts, the last one cut; 0: none)")
    parser.add_argument("--tile-rows", type=int, nargs="+", default=[48])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--linear-variants", nargs="+", default=["linear", "mkldnn_packed", "mkl_packed"])
    parser.add_argument("--trace", default="traces/sharegpt.json")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens-cap", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=0,
                        help="e2e: only trace requests with prompts this long (60: the first 64 of "
                             "traces/sharegpt.json average 281 prompt tokens, like the issue's sample)")
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME:key=value,... engine arguments of one configuration (repeatable)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    with torch.inference_mode():
        if args.what == "attn":
            run_attn(args)
        elif args.what == "step":
            run_step(args)
        elif args.what == "linear":
            run_linear(args)
        else:
            args.variant = args.variant or ["torch:attention_backend=torch", "cpu:attention_backend=cpu"]
            run_e2e(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
